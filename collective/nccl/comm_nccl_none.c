/*
 * comm_nccl_none.c — the nccl backend's entry in a build without CUDA or
 * without the NCCL library: the registry answers that there is none.
 */
#include "collective_impl.h"

const kpl__comm_backend *kpl__comm_nccl_backend(void)
{
    KPL_ERROR(KPL_EBACKEND, "comm_create: this build of kpl has no nccl backend (built "
              "without CUDA or without the NCCL library); CUDA tensors cannot be "
              "communicated");
    return NULL;
}
