/* Backend dispatch: prism_backend_create() by device name.
 *
 * The CPU backend is linked in. The CUDA backend is a shared module (libprism_backend_cuda.so,
 * ggml-style) opened with dlopen the first time "cuda" is asked for or probed, so a process that
 * runs on the CPU never maps cudart or cuBLAS — about 150 MiB resident per process that its
 * memory plan would otherwise have to count. The module is looked for in $PRISM_BACKEND_DIR,
 * next to the executable, in ../lib beside it, in the build's lib/ folder, then on the normal
 * library path. Processes export their symbols (-rdynamic) so the module shares their
 * allocator counters and log settings. */
#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CUDA_MODULE "libprism_backend_cuda.so"

static struct {
    pthread_once_t once;
    void *handle;
    __typeof__(&prism_backend_cuda_create) create;
    __typeof__(&prism_cuda_available) available;
    char error[512];          /* why the module could not be opened (the last candidate's dlerror) */
} g_cuda = {.once = PTHREAD_ONCE_INIT};

static void *module_try(const char *dir, const char *file, char *err, size_t errlen)
{
    char path[PATH_MAX];
    if (dir && (!*dir || snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path)) return NULL;
    void *h = dlopen(dir ? path : file, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        /* "cannot open shared object file" is the usual miss; anything else (a missing libcudart,
         * a bad build) is worth reporting over it. */
        if (e && err && errlen && (!err[0] || !strstr(e, "No such file")))
            snprintf(err, errlen, "%s", e);
        return NULL;
    }
    PRISM_DEBUG("backend: module %s", dir ? path : file);
    return h;
}

void *prism_backend_module_open(const char *file, char *err, size_t errlen)
{
    if (err && errlen) err[0] = 0;
    void *h = module_try(getenv("PRISM_BACKEND_DIR"), file, err, errlen);
    if (h) return h;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 8);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            if ((h = module_try(exe, file, err, errlen))) return h;
            strcat(exe, "/../lib");
            if ((h = module_try(exe, file, err, errlen))) return h;
        }
    }
#ifdef PRISM_BACKEND_BUILD_DIR
    if ((h = module_try(PRISM_BACKEND_BUILD_DIR, file, err, errlen))) return h;
#endif
    h = module_try(NULL, file, err, errlen);
    if (!h && err && errlen && !err[0]) snprintf(err, errlen, "%s not found", file);
    return h;
}

static void cuda_load(void)
{
    void *h = prism_backend_module_open(CUDA_MODULE, g_cuda.error, sizeof g_cuda.error);
    if (!h) return;
    g_cuda.create = (__typeof__(g_cuda.create))dlsym(h, "prism_backend_cuda_create");
    g_cuda.available = (__typeof__(g_cuda.available))dlsym(h, "prism_cuda_available");
    if (!g_cuda.create || !g_cuda.available) {
        snprintf(g_cuda.error, sizeof g_cuda.error, "%s: missing entry points", CUDA_MODULE);
        dlclose(h);
        g_cuda.create = NULL;
        g_cuda.available = NULL;
        return;
    }
    g_cuda.handle = h;
}

static bool cuda_module(void)
{
    pthread_once(&g_cuda.once, cuda_load);
    return g_cuda.handle != NULL;
}

bool prism_backend_has_cuda(void)
{
    return cuda_module() && g_cuda.available();  /* the module loads and a device is present */
}

int prism_backend_create(const char *device, int n_threads, size_t pool_bytes, prism_backend_t **out)
{
    *out = NULL;
    if (!device || strcmp(device, "cpu") == 0) {
        *out = prism_backend_cpu_create_pool(n_threads, pool_bytes);
        return *out ? PRISM_OK : PRISM_ENOMEM;
    }
    if (strncmp(device, "cuda", 4) == 0 && (device[4] == '\0' || device[4] == ':')) {
        if (!cuda_module()) {
            PRISM_WARN("backend: '%s' requested but the CUDA backend module (%s) cannot be loaded: %s", device,
                       CUDA_MODULE, g_cuda.error[0] ? g_cuda.error : "not found");
            return PRISM_ENOTSUP;
        }
        int dev = device[4] == ':' ? atoi(device + 5) : 0;
        int status = PRISM_OK;
        *out = g_cuda.create(dev, pool_bytes, &status);
        return *out ? PRISM_OK : (status ? status : PRISM_ENOTSUP);
    }
    return PRISM_EINVAL;
}

int prism_backend_set_weight_dtype(prism_backend_t *be, prism_dtype_t dt)
{
    if (dt == be->weight_dtype) return PRISM_OK;
    if (!be->i.set_weight_dtype) return PRISM_ENOTSUP;
    int rc = be->i.set_weight_dtype(be->ctx, dt);
    if (rc == PRISM_OK) be->weight_dtype = dt;
    return rc;
}

int prism_backend_set_compute_dtype(prism_backend_t *be, prism_dtype_t dt)
{
    if (dt == be->compute_dtype) return PRISM_OK;
    if (!be->i.set_compute_dtype) return PRISM_ENOTSUP;
    if (dt == PRISM_DTYPE_BF16) {
        int rc = prism_backend_set_weight_dtype(be, PRISM_DTYPE_BF16);
        if (rc != PRISM_OK) return rc;
    }
    int rc = be->i.set_compute_dtype(be->ctx, dt);
    if (rc == PRISM_OK) be->compute_dtype = dt;
    return rc;
}

void prism_backend_destroy(prism_backend_t *be)
{
    if (!be) return;
    be->i.destroy(be->ctx);
    prism_free(be);
}
