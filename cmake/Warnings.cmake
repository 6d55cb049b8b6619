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
set(TREEVERIFY_CPU_ARCH "x86-64-v3" CACHE STRING "-march for the CPU backend (empty: compiler default)")
