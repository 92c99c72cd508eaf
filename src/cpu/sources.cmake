# The CPU backend's sources, added to the `dualkv` target by the top-level CMakeLists.txt.
#
# tile_kernels.cpp (Eigen) is compiled once per instruction set, each copy with its flags, its
# own name for Eigen's namespace (so the copies' inline functions never merge at link time) and
# -O2 even in Debug builds (Eigen unoptimised is ~100x slower, too slow for the sanitizer suite);
# the amx set is tile_kernels_amx.cpp, compiled the same way. tile_kernels_select.cpp picks one
# per dtype at run time (tile_kernels.h).
find_package(Eigen3 3.3 REQUIRED NO_MODULE)

target_sources(dualkv PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/attention_cpu.cpp
  ${CMAKE_CURRENT_LIST_DIR}/blocked.cpp
  ${CMAKE_CURRENT_LIST_DIR}/parallel.cpp
  ${CMAKE_CURRENT_LIST_DIR}/reference.cpp
  ${CMAKE_CURRENT_LIST_DIR}/tile_kernels_select.cpp
  ${CMAKE_CURRENT_LIST_DIR}/tiles.cpp)

set(DUALKV_CPU_ISAS generic)
set(DUALKV_CPU_FLAGS_generic "")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  list(APPEND DUALKV_CPU_ISAS avx2 avx512)
  set(DUALKV_CPU_FLAGS_avx2 -mavx2 -mfma)
  set(DUALKV_CPU_FLAGS_avx512 -mavx512f -mavx512dq -mavx512vl -mavx512bw -mavx2 -mfma)
  target_compile_definitions(dualkv PRIVATE DUALKV_CPU_HAVE_X86_ISAS)
endif()

# amx: tile_kernels_amx.cpp (bfloat16 products on AMX tiles), built by compilers that know the
# AMX intrinsics (GCC 11, Clang 12 and later).
include(CheckCXXCompilerFlag)
check_cxx_compiler_flag("-mamx-tile -mamx-bf16 -mavx512bf16" DUALKV_COMPILER_HAS_AMX)
if(DUALKV_CPU_ISAS MATCHES "avx512" AND DUALKV_COMPILER_HAS_AMX)
  list(APPEND DUALKV_CPU_ISAS amx)
  set(DUALKV_CPU_FLAGS_amx ${DUALKV_CPU_FLAGS_avx512} -mavx512bf16 -mamx-tile -mamx-bf16)
  set(DUALKV_CPU_SOURCE_amx tile_kernels_amx.cpp)
  target_compile_definitions(dualkv PRIVATE DUALKV_CPU_HAVE_AMX)
endif()

foreach(isa IN LISTS DUALKV_CPU_ISAS)
  if(NOT DUALKV_CPU_SOURCE_${isa})
    set(DUALKV_CPU_SOURCE_${isa} tile_kernels.cpp)
  endif()
  add_library(dualkv_cpu_${isa} OBJECT ${CMAKE_CURRENT_LIST_DIR}/${DUALKV_CPU_SOURCE_${isa}})
  target_include_directories(dualkv_cpu_${isa} PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/include)
  target_link_libraries(dualkv_cpu_${isa} PRIVATE Eigen3::Eigen)
  target_compile_definitions(dualkv_cpu_${isa} PRIVATE DUALKV_CPU_ISA=${isa} Eigen=dualkv_eigen_${isa})
  target_compile_options(dualkv_cpu_${isa} PRIVATE ${DUALKV_CPU_FLAGS_${isa}} -O2)
  target_sources(dualkv PRIVATE $<TARGET_OBJECTS:dualkv_cpu_${isa}>)
endforeach()
