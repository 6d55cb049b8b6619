# Warnings are on for our own targets only (treeverify_set_warnings), never for generated code
# or third-party headers. -Wmissing-field-initializers is off: C++20 designated initializers
# that leave members at their in-class defaults are the style of our params structs.
option(TREEVERIFY_WERROR "Treat warnings as errors" OFF)

function(treeverify_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-missing-field-initializers $<$<BOOL:${TREEVERIFY_WERROR}>:-Werror>>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
endfunction()

# The CPU backend's inner loops are written with AVX2/FMA in mind. x86-64-v3 (Haswell, 2013, and
# every EPYC) is the baseline on our build, CI and GPU hosts; a different one can be chosen.
# A host without AVX2/FMA (some VMs) gets the compiler's default instead of crashing on SIGILL.
set(_treeverify_default_arch "")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND EXISTS /proc/cpuinfo)
  file(READ /proc/cpuinfo _treeverify_cpuinfo)
  if(_treeverify_cpuinfo MATCHES " avx2" AND _treeverify_cpuinfo MATCHES " fma")
    set(_treeverify_default_arch "x86-64-v3")
  endif()
endif()
set(TREEVERIFY_CPU_ARCH "${_treeverify_default_arch}" CACHE STRING
    "-march for the CPU backend (empty: compiler default)")
