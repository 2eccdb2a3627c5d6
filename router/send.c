/* Messages from the router to one worker, over the control socket (control.c binds it): work
 * (Encode, Prefill) and aborts. Beside the registry: a failed send marks the worker unreachable,
 * so the picks pass it over until it is heard from again. */
#include "router.h"

#include <string.h>

int router_send(router_t *r, router_worker_t *w, Prism__Envelope *env, const prism_frame_t *frames, int n)
{
    env->router_id = r->router_id;
    if (env->request_id && !(env->trace_id_hi | env->trace_id_lo)) {   /* an abort: its request's trace */
        prism_log_ctx_t lc = router_req_log(r, env->request_id);
        env->trace_id_hi = lc.trace.hi;
        env->trace_id_lo = lc.trace.lo;
    }
    int rc = prism_msg_send(r->ctl, w->id, strlen(w->id), env, frames, n, ZMQ_DONTWAIT);
    if (rc != PRISM_OK) {
        PRISM_WARN("send to %s worker %s failed: %s", prism_role_name(w->role), w->id, prism_strerror(rc));
        w->send_failed_at = prism_now_s();  /* router_pick passes it over until it is heard from again */
    }
    return rc;
}

void router_send_abort(router_t *r, router_worker_t *w, uint64_t rid)
{
    Prism__Abort a = PRISM__ABORT__INIT;
    Prism__Envelope env = PRISM__ENVELOPE__INIT;
    env.type = PRISM__MSG_TYPE__MSG_ABORT;
    env.request_id = rid;
    env.abort = &a;
    router_send(r, w, &env, NULL, 0);
}

void router_send_abort_to(router_t *r, const char *worker_id, uint64_t rid)
{
    router_worker_t *w = worker_id[0] ? router_worker_by_id(r, worker_id) : NULL;
    if (w) router_send_abort(r, w, rid);
}
