# Hopper (sm_90a) forward kernels, include()d by src/cuda/CMakeLists.txt when DUALKV_CUDA_ARCHS
# contains 90a. Defines, for the caller to add to its CUDA object library:
#   DKV_SM90_SOURCES      the translation units (one per head dim x dtype, plus the host helpers)
#   DKV_SM90_DEFINITIONS  DUALKV_SM90_HDIM_<d>=1 per instantiated head dim, DUALKV_WITH_SM90=1
#   DKV_SM90_OPTIONS      compile options for those sources (sm_90a only: wgmma/setmaxnreg need it)
# Head dims instantiated: those of DUALKV_HEAD_DIMS that the kernel supports (64, 128, 256).
set(_dkv_sm90_dir ${CMAKE_CURRENT_LIST_DIR})
set(_dkv_sm90_supported 64 128 256)
set(DKV_SM90_SOURCES ${_dkv_sm90_dir}/fwd_sm90_common.cu)
set(DKV_SM90_DEFINITIONS DUALKV_WITH_SM90=1)
foreach(_hdim IN LISTS DUALKV_HEAD_DIMS)
  if(_hdim IN_LIST _dkv_sm90_supported)
    list(APPEND DKV_SM90_SOURCES ${_dkv_sm90_dir}/fwd_sm90_hdim${_hdim}_bf16.cu
                                 ${_dkv_sm90_dir}/fwd_sm90_hdim${_hdim}_fp16.cu)
    list(APPEND DKV_SM90_DEFINITIONS DUALKV_SM90_HDIM_${_hdim}=1)
  endif()
endforeach()
set(DKV_SM90_OPTIONS -gencode=arch=compute_90a,code=sm_90a)

# Hopper backward main kernel (bwd_sm90_*): its units for the head dims of DUALKV_HEAD_DIMS it supports
# (64, 128: bwd_sm90_kernel.cuh; 256: bwd_sm90_kernel_d256.cuh), DUALKV_WITH_SM90_BWD=1 and
# DUALKV_SM90_BWD_HDIM_<d>=1 (api_cuda.cu dispatches on them).
set(_dkv_sm90_bwd_supported 64 128 256)
list(APPEND DKV_SM90_SOURCES ${_dkv_sm90_dir}/bwd_sm90_common.cu)
list(APPEND DKV_SM90_DEFINITIONS DUALKV_WITH_SM90_BWD=1)
foreach(_hdim IN LISTS DUALKV_HEAD_DIMS)
  if(_hdim IN_LIST _dkv_sm90_bwd_supported)
    list(APPEND DKV_SM90_SOURCES ${_dkv_sm90_dir}/bwd_sm90_hdim${_hdim}_bf16.cu
                                 ${_dkv_sm90_dir}/bwd_sm90_hdim${_hdim}_fp16.cu)
    list(APPEND DKV_SM90_DEFINITIONS DUALKV_SM90_BWD_HDIM_${_hdim}=1)
  endif()
endforeach()
