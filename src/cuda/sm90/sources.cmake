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

# Hopper backward main kernel (bwd_sm90_*), DUALKV_SM90_BWD (default ON): its units for the head
# dims of DUALKV_HEAD_DIMS it supports (64, 128), DUALKV_WITH_SM90_BWD=1 and
# DUALKV_SM90_BWD_HDIM_<d>=1 (api_cuda.cu dispatches on them). OFF leaves the portable backward
# main kernel on Hopper too (build time: 4 fewer units).
option(DUALKV_SM90_BWD "Compile the Hopper (sm_90a) backward main kernel" ON)
if(DUALKV_SM90_BWD)
  set(_dkv_sm90_bwd_supported 64 128)
  list(APPEND DKV_SM90_SOURCES ${_dkv_sm90_dir}/bwd_sm90_common.cu)
  list(APPEND DKV_SM90_DEFINITIONS DUALKV_WITH_SM90_BWD=1)
  foreach(_hdim IN LISTS DUALKV_HEAD_DIMS)
    if(_hdim IN_LIST _dkv_sm90_bwd_supported)
      list(APPEND DKV_SM90_SOURCES ${_dkv_sm90_dir}/bwd_sm90_hdim${_hdim}_bf16.cu
                                   ${_dkv_sm90_dir}/bwd_sm90_hdim${_hdim}_fp16.cu)
      list(APPEND DKV_SM90_DEFINITIONS DUALKV_SM90_BWD_HDIM_${_hdim}=1)
    endif()
  endforeach()
  # Head dim 256 (bwd_sm90_kernel_d256.cuh: the two consumer warpgroups split the work by role, S/P/dV
  # and dP/dS/dK), DUALKV_SM90_BWD_D256 (default ON; OFF keeps the portable backward at head dim
  # 256, 2 fewer units): its two units and DUALKV_SM90_BWD_HDIM_256=1 when 256 is in DUALKV_HEAD_DIMS.
  option(DUALKV_SM90_BWD_D256 "Compile the Hopper backward main kernel for head dim 256" ON)
  if(DUALKV_SM90_BWD_D256 AND (256 IN_LIST DUALKV_HEAD_DIMS))
    list(APPEND DKV_SM90_SOURCES ${_dkv_sm90_dir}/bwd_sm90_hdim256_bf16.cu ${_dkv_sm90_dir}/bwd_sm90_hdim256_fp16.cu)
    list(APPEND DKV_SM90_DEFINITIONS DUALKV_SM90_BWD_HDIM_256=1)
  endif()
  # dQ of head dims 64/128 by smem staging + TMA bulk reduce-add instead of per-thread 16-byte
  # atomics (bwd_sm90_kernel.cuh), DUALKV_SM90_BWD_DQ_BULK (default ON: the main kernel 23% faster
  # on the H200, docs/hopper.md). OFF builds the atomic variant for an A/B.
  dkv_variant_option(DUALKV_SM90_BWD_DQ_BULK "Hopper backward: dQ by TMA bulk reduce-add (OFF: per-thread atomics)"
                     ON DKV_SM90_DEFINITIONS)
  # Head dims 64/128: P^T = exp2(...) computed in a uniform branch (masked / unmasked step) so that
  # ptxas keeps it under the dP^T wgmma instead of after its wait, no per-element mask arithmetic on
  # unmasked steps, no row selects when staging dQ of a full query tile, and the step's query tile
  # by counting instead of a division (bwd_sm90_kernel.cuh), DUALKV_SM90_BWD_SOFTMAX_OVERLAP (default
  # ON since the H200 A/B at 274e72f: main kernel 4-6% faster, outputs bit for bit equal; docs/hopper.md
  # "Where the D = 128 backward step's tensor pipe idles"). OFF builds the earlier step for an A/B.
  dkv_variant_option(DUALKV_SM90_BWD_SOFTMAX_OVERLAP
                     "Hopper backward, head dims 64/128: softmax under the dP wgmma, unmasked fast path"
                     ON DKV_SM90_DEFINITIONS)
  # dQ of head dim 256 by TMA bulk reduce-adds too, staged in the step's Q/dO stage once its last
  # reader retired (bwd_sm90_kernel_d256.cuh; no smem is left for separate staging buffers),
  # DUALKV_SM90_BWD_D256_DQ_BULK (default ON: fwd+bwd 1.24-1.35x faster at head dim 256 on the H200,
  # docs/hopper.md; needs DUALKV_SM90_BWD_DQ_BULK). OFF builds the atomic variant for an A/B.
  dkv_variant_option(DUALKV_SM90_BWD_D256_DQ_BULK
                     "Hopper backward, head dim 256: dQ by TMA bulk reduce-add (OFF: per-thread atomics)"
                     ON DKV_SM90_DEFINITIONS REQUIRES DUALKV_SM90_BWD_DQ_BULK)  # its dq_accum tensor map
endif()
