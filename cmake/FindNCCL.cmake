# FindNCCL: NCCL headers and the shared library by its SONAME (libnccl.so.2).
#
# Search order: NCCL_HOME / NCCL_ROOT (CMake or environment; then only there), else the nvidia-nccl-cu13
# / -cu12 wheel of the Python interpreter on PATH (site-packages/nvidia/nccl/{include,lib}), then the system.
# Defines NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION and the target NCCL::nccl.
#
# The target links the SONAME libnccl.so.2 (not a versioned file), so that at run time the dynamic
# loader resolves it to whichever libnccl.so.2 the process already loaded (torch's): one NCCL.

set(_nccl_hints)
foreach(_v NCCL_HOME NCCL_ROOT)
  if(DEFINED ${_v} AND NOT "${${_v}}" STREQUAL "")
    list(APPEND _nccl_hints "${${_v}}")
  endif()
  if(DEFINED ENV{${_v}} AND NOT "$ENV{${_v}}" STREQUAL "")
    list(APPEND _nccl_hints "$ENV{${_v}}")
  endif()
endforeach()

if(NOT _nccl_hints)
  if(Python_EXECUTABLE)
    set(_nccl_py "${Python_EXECUTABLE}")
  else()
    find_program(_nccl_py_prog NAMES python3 python)
    set(_nccl_py "${_nccl_py_prog}")
  endif()
  if(_nccl_py)
    execute_process(
      COMMAND "${_nccl_py}" -c "import importlib.util as u, os\nfor n in ('nvidia.nccl',):\n    s = u.find_spec(n)\n    if s and s.submodule_search_locations:\n        print(list(s.submodule_search_locations)[0]); break"
      OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_nccl_wheel AND EXISTS "${_nccl_wheel}/include/nccl.h")
      list(APPEND _nccl_hints "${_nccl_wheel}")
    endif()
  endif()
endif()

# NCCL_HOME / NCCL_ROOT given: that NCCL or none (not a system copy found instead).
set(_nccl_only)
if(_nccl_hints AND NOT _nccl_wheel)
  set(_nccl_only NO_DEFAULT_PATH)
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include ${_nccl_only})
# Prefer the SONAME file; fall back to the unversioned development link.
find_library(NCCL_LIBRARY NAMES libnccl.so.2 nccl HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64 ${_nccl_only})

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_maj REGEX "^#define NCCL_MAJOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_min REGEX "^#define NCCL_MINOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_pat REGEX "^#define NCCL_PATCH +[0-9]+")
  string(REGEX REPLACE "[^0-9]*([0-9]+)$" "\\1" _nccl_maj "${_nccl_maj}")
  string(REGEX REPLACE "[^0-9]*([0-9]+)$" "\\1" _nccl_min "${_nccl_min}")
  string(REGEX REPLACE "[^0-9]*([0-9]+)$" "\\1" _nccl_pat "${_nccl_pat}")
  set(NCCL_VERSION "${_nccl_maj}.${_nccl_min}.${_nccl_pat}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_INCLUDE_DIR NCCL_LIBRARY VERSION_VAR NCCL_VERSION
  REASON_FAILURE_MESSAGE "set NCCL_HOME (a CMake variable or the environment) to an NCCL install with include/nccl.h and lib/libnccl.so.2, e.g. <site-packages>/nvidia/nccl of the nvidia-nccl-cu13 wheel")

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl SHARED IMPORTED)
  get_filename_component(_nccl_libdir "${NCCL_LIBRARY}" DIRECTORY)
  # IMPORTED_NO_SONAME OFF + IMPORTED_SONAME: the linker records DT_NEEDED libnccl.so.2.
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    IMPORTED_SONAME "libnccl.so.2"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  message(STATUS "allscan: NCCL ${NCCL_VERSION} from ${NCCL_LIBRARY}")
endif()
