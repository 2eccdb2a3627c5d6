/* aborts: what a worker remembers of aborts for requests it does not hold (yet).
 *
 * An Abort comes from the router on the control link, a request's data (KV for decode) from
 * another worker on a data link: nothing orders the two, so the abort of a request whose client
 * hung up during prefill may reach decode before its KV. Without a memory the KV is admitted
 * later and decodes to max_tokens for nobody. The owner (one worker loop) adds an entry when an
 * abort names a request it does not have, and takes it when that request's data arrives (then
 * dropped; prefill keeps it for every image's embeddings). Bounded: PRISM_ABORT_MEMO_CAP entries, the oldest forgotten first, each kept at most
 * ttl_s seconds (the router gives up on a request long before). No allocation.
 *
 *   prism_abort_memo_init(&m, 600);
 *   on Abort for an unknown request:  prism_abort_memo_add(&m, rid, router_id, prism_now_s());
 *   on its data:                      if (prism_abort_memo_take(&m, rid, router_id, now)) drop it;
 */
#ifndef PRISM_WORKER_ABORTS_H
#define PRISM_WORKER_ABORTS_H

#include "core/core.h"

#define PRISM_ABORT_MEMO_CAP 1024

typedef struct {
    uint64_t rid;
    char router_id[128];
    double t;
    bool used;
} prism_abort_entry_t;

typedef struct {
    prism_abort_entry_t e[PRISM_ABORT_MEMO_CAP];   /* ring, oldest at head */
    int head, n;
    double ttl_s;
    uint64_t forgotten;    /* entries pushed out by newer ones before they expired */
    uint64_t dropped;      /* requests whose data came after their abort and was dropped */
} prism_abort_memo_t;

void prism_abort_memo_init(prism_abort_memo_t *m, double ttl_s);
void prism_abort_memo_add(prism_abort_memo_t *m, uint64_t rid, const char *router_id, double now);
/* True (and the entry is forgotten) when this request was aborted within ttl_s. */
bool prism_abort_memo_take(prism_abort_memo_t *m, uint64_t rid, const char *router_id, double now);
/* The same, keeping the entry (a request whose data comes in several messages: one per image). */
bool prism_abort_memo_has(const prism_abort_memo_t *m, uint64_t rid, const char *router_id, double now);

#endif
