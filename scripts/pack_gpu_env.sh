#!/usr/bin/env bash
# Pack the wheels the GPU machine needs into one carry: .gpuenv/env.tar.xz (git-ignored).
#
#   scripts/pack_gpu_env.sh        (from the project's root, after ../shared/tools/device_wheels.sh [--hf] and
#                                   ../shared/tools/device_tilelang.sh filled .whl/, .whlhf/, .tl1/, .tl2/)
#
# The wheels are unpacked (python 3.12, the machine's) and compressed with xz -9: fla-core, yunchang, transformers
# and tilelang come to about 49 MB, where their wheels (about 110 MB) needed two device calls on a warm machine.
# z3's second copy of its library becomes a link and its command-line binary is left out (tilelang loads the
# library), hf_xet and the rich/pygments CLI deps too (nothing downloads there). Then carry [".gpuenv"];
# scripts/gpu_suite.sh unpacks it into /tmp/gpuenv once per machine and puts it on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
n=0
for d in .whl .whlhf .tl1 .tl2; do
  for w in "$d"/*.whl; do
    [ -f "$w" ] || continue
    case $(basename "$w") in hf_xet-*|rich-*|pygments-*) continue ;; esac
    python3 -m zipfile -e "$w" "$stage"
    n=$((n + 1))
  done
done
[ "$n" -gt 0 ] || { echo "pack_gpu_env.sh: no wheels in .whl/ .whlhf/ .tl1/ .tl2/" >&2; exit 1; }
# a wheel's .data/purelib and platlib belong at the root; its scripts, headers and data (z3's binary) are not needed
for data in "$stage"/*.data; do
  [ -d "$data" ] || continue
  for lib in purelib platlib; do [ -d "$data/$lib" ] && cp -a "$data/$lib/." "$stage/"; done
  rm -rf "$data"
done
if [ -f "$stage/z3/lib/libz3.so" ]; then
  for f in "$stage"/z3/lib/libz3.so.*; do [ -f "$f" ] && ! [ -L "$f" ] && rm "$f" && ln -s libz3.so "$f"; done
fi
chmod 755 "$stage"  # the archive's root: mktemp's 0700 would become /tmp/gpuenv's
mkdir -p .gpuenv  # git-ignored
XZ_OPT="-9 -T0" tar -cJf .gpuenv/env.tar.xz -C "$stage" .
echo "$n wheels -> .gpuenv/env.tar.xz $(du -m .gpuenv/env.tar.xz | cut -f1) MB (a call carries 64 MB with the tree)"
