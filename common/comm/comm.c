/* The one-rank communicator and process liveness helpers shared by the transports. */
#include "comm/comm_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- processes */

uint64_t prism_proc_start_time(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    /* "pid (comm) S ppid ..." — comm may hold spaces and parentheses: parse after the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    p += 2;
    char state = *p;
    if (state == 'Z' || state == 'X' || state == 'x') return 0;   /* dead, not yet reaped */
    /* field 3 is the state; the start time is field 22 */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

bool prism_proc_alive(pid_t pid, uint64_t start_time)
{
    if (pid <= 0) return true;   /* not checkable */
    uint64_t s = prism_proc_start_time(pid);
    return s != 0 && (start_time == 0 || s == start_time);
}

/* ---------------------------------------------------------------- one rank */

static const char *single_name(void *ctx) { (void)ctx; return "single"; }
static int single_all_reduce(void *ctx, float *buf, size_t n) { (void)ctx; (void)buf; (void)n; return PRISM_OK; }
static int single_all_gather(void *ctx, void *out, const void *in, size_t bytes)
{
    (void)ctx;
    if (bytes) memmove(out, in, bytes);
    return PRISM_OK;
}
static int single_broadcast(void *ctx, void *buf, size_t bytes, int root)
{
    (void)ctx; (void)buf; (void)bytes;
    return root == 0 ? PRISM_OK : PRISM_EINVAL;
}
static int single_wait(void *ctx) { (void)ctx; return PRISM_OK; }
static void single_abort(void *ctx) { (void)ctx; }
static void single_destroy(void *ctx) { (void)ctx; }

prism_comm_t *prism_comm_single_create(void)
{
    prism_comm_t *c = prism_xcalloc(1, sizeof *c);
    c->i = (prism_comm_i){
        .name = single_name, .all_reduce_sum = single_all_reduce, .all_gather = single_all_gather,
        .broadcast = single_broadcast, .wait = single_wait, .abort = single_abort, .destroy = single_destroy,
    };
    c->size = 1;
    c->rank = 0;
    return c;
}

void prism_comm_destroy(prism_comm_t *c)
{
    if (!c) return;
    c->i.destroy(c->ctx);
    prism_free(c);
}
