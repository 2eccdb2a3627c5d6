/* Backend dispatch: prism_backend_create() by device name. */
#include "backend/backend.h"

#include <stdlib.h>
#include <string.h>

#ifdef PRISM_WITH_CUDA
prism_backend_t *prism_backend_cuda_create(int device, size_t pool_bytes, int *status);
bool prism_cuda_available(void);
#endif

bool prism_backend_has_cuda(void)
{
#ifdef PRISM_WITH_CUDA
    return prism_cuda_available();  /* built with CUDA and a device is present */
#else
    return false;
#endif
}

int prism_backend_create(const char *device, int n_threads, size_t pool_bytes, prism_backend_t **out)
{
    *out = NULL;
    if (!device || strcmp(device, "cpu") == 0) {
        *out = prism_backend_cpu_create_pool(n_threads, pool_bytes);
        return *out ? PRISM_OK : PRISM_ENOMEM;
    }
    if (strncmp(device, "cuda", 4) == 0 && (device[4] == '\0' || device[4] == ':')) {
#ifdef PRISM_WITH_CUDA
        int dev = device[4] == ':' ? atoi(device + 5) : 0;
        int status = PRISM_OK;
        *out = prism_backend_cuda_create(dev, pool_bytes, &status);
        return *out ? PRISM_OK : (status ? status : PRISM_ENOTSUP);
#else
        PRISM_WARN("backend: '%s' requested but this build has no CUDA backend", device);
        return PRISM_ENOTSUP;
#endif
    }
    return PRISM_EINVAL;
}

void prism_backend_destroy(prism_backend_t *be)
{
    if (!be) return;
    be->i.destroy(be->ctx);
    prism_free(be);
}
