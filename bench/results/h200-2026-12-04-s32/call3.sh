#!/usr/bin/env bash
# Call 3 (carries .whl, .tl1): build; tilelang part 1 (the machine stays warm for call 4).
set -u
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl1/*.whl >> $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1
echo "build rc=$? $(grep real $L/01_build.txt)"
