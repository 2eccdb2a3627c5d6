/* http_server: the router's HTTP/1.1 front door (libuv + llhttp), one loop thread.
 *
 * What it does: keep-alive (HTTP/1.1 default, HTTP/1.0 with "Connection: keep-alive",
 * "Connection: close" honoured), pipelining (requests on one connection are handled strictly one
 * after the other: the next one is not parsed until the previous response is complete), request
 * bodies with Content-Length or chunked encoding, "Expect: 100-continue", fixed or chunked responses,
 * per-connection idle timeout, a connection cap, and bounded input:
 *   - header bytes (request line + header lines) > max_header_bytes  -> 431, connection closed
 *   - body bytes > max_body_bytes (checked while the body streams in) -> 413 JSON error, closed
 *   - body bytes held over all connections >= max_body_bytes_total     -> reading pauses (backpressure);
 *     paused longer than max_pause_s                                   -> 503 + Retry-After, closed
 *   - headers not complete header_timeout_s after the request's first byte, or a body slower than
 *     min_body_rate on average after body_grace_s (slowloris)        -> 408, closed
 *   - chunk extensions of one request > max_header_bytes              -> 400, closed
 *   - refused by the on_headers hook (e.g. a bad API key)             -> its status, before the body is read
 *   - malformed HTTP, protocol upgrades after their answer            -> 400, connection closed
 *   - lenient framing: obs-fold, a Transfer-Encoding other than chunked, none or several Host
 *     headers (HTTP/1.1)                                                -> 400, connection closed
 *   - a Host not in allowed_hosts (when set)                         -> 403; a POST not JSON (require_json) -> 415
 *   - connections >= max_connections: the new one is accepted, answered 503 and closed (closing
 *     ones count until their socket is closed)
 *   - unsent answer bytes not taken by the client at min_write_rate after write_grace_s -> closed;
 *     the next pipelined request waits while more than max_pipeline_bytes are unsent
 * These error answers use the OpenAI error shape {"error":{"message","type","param","code"}}.
 *
 * OWNERSHIP RULE (read this):
 *   The handler receives a request holding ONE reference that belongs to the caller. The caller must
 *   call prism_http_req_release(r) exactly once, whenever it is done with r (right after responding,
 *   or much later after an asynchronous response). The connection keeps its own reference while the
 *   request is on it, so r stays valid memory until both are gone. Accessors (method, path, headers,
 *   body, user pointer) stay valid until the caller's release.
 *   If the client goes away before the response completed, the abort callback (if set) fires once,
 *   from the loop thread; from then on respond/stream calls return PRISM_EIO without touching the
 *   socket, and the caller still releases r as usual. The abort callback never fires for a request
 *   whose handler has not run, and NEVER from inside a respond / stream / drop call: a write that
 *   fails there makes the call return PRISM_EIO and the connection closes from a later loop turn,
 *   where the callback runs. So code that writes may keep using its own state after the write,
 *   whatever the abort callback frees. (prism_http_server_stop is the one call that runs abort
 *   callbacks inside itself.) Everything here runs on the loop thread only, but for reads of a
 *   request's method, path, headers, body and images (prism_http_req_peek_image) by another thread
 *   while the caller holds r and makes no call on it: the router prepares requests on a thread pool.
 *   A request may be released after the server stopped; the server's memory outlives its requests.
 *
 * Usage:
 *   static void on_req(prism_http_req_t *r, void *ud) {
 *       prism_http_respond(r, 200, "application/json", NULL, "{}", 2);
 *       prism_http_req_release(r);
 *   }
 *   prism_http_config_t cfg = prism_http_config_default();
 *   cfg.port = 8000;
 *   prism_http_server_t *s;
 *   if (prism_http_server_start(loop, &cfg, on_req, NULL, &s) == PRISM_OK) uv_run(loop, UV_RUN_DEFAULT);
 *   ... later, on the loop thread: prism_http_server_stop(s);  (then let the loop run to close handles)
 */
#ifndef PRISM_ROUTER_HTTP_SERVER_H
#define PRISM_ROUTER_HTTP_SERVER_H

#include "core/core.h"

#include <uv.h>

typedef struct prism_http_server prism_http_server_t;
typedef struct prism_http_req prism_http_req_t;
typedef void (*prism_http_handler_fn)(prism_http_req_t *req, void *ud);

/* The caller's word on a lifted image whose bytes are still arriving (prism_http_config_t.image_check):
 * these, or an HTTP status (>= 400) to refuse the request. */
enum {
    PRISM_HTTP_IMAGE_MORE = 0,   /* no verdict yet: ask again when more bytes are in */
    PRISM_HTTP_IMAGE_OK = 1,     /* nothing to refuse (the handler checks the whole image again) */
};

/* The caller's word on one body in progress (prism_http_config_t.body_gate). */
typedef enum {
    PRISM_HTTP_BODY_READ,   /* go on */
    PRISM_HTTP_BODY_WAIT,   /* wait as for a spent budget: the oldest body in progress goes on */
    PRISM_HTTP_BODY_HOLD,   /* wait, the oldest too: the room comes back by itself, not from bodies */
} prism_http_body_gate_t;

typedef struct {
    const char *host;          /* bind address, "127.0.0.1" when NULL */
    int port;                  /* 0 = ephemeral (see prism_http_server_port) */
    size_t max_header_bytes;   /* request line + headers; 0 = 64 KiB; beyond: 431 */
    size_t max_body_bytes;     /* 0 = 64 MiB; beyond: 413 (OpenAI-style JSON error) */
    size_t max_body_bytes_total; /* body bytes held at once over all connections, charged as the bytes
                                * arrive; 0 = 1 GiB. When they are all spent, connections stop reading
                                * their bodies (TCP backpressure) until bytes are released: only the
                                * oldest body in progress keeps reading, so paused bodies cannot lock each
                                * other out. A body whose declared length is over the whole budget: 503
                                * from the header. */
    double max_pause_s;        /* a body paused this long is answered 503 + Retry-After (after its upload,
                                * which is read and discarded); 0 = 120 s */
    bool lift_data_urls;       /* bodies stream through the data-URL lifter (body_lift.h): the body the
                                * handler reads is the skeleton, images are taken with
                                * prism_http_req_take_image */
    int max_connections;       /* 0 = 1024; beyond: accept, answer 503, close */
    double idle_timeout_s;     /* keep-alive idle timeout between requests; 0 = 60 s (a proxy in front
                                * keeps its own shorter: deploy/nginx/prism.conf's upstream
                                * keepalive_timeout, deploy/haproxy/prism.cfg's timeout
                                * http-keep-alive with http-reuse never; both checked by
                                * test_loadbalancer.py) */
    double header_timeout_s;   /* request line + headers within this of the first byte; 0 = 30 s; else 408 */
    size_t min_body_rate;      /* bytes/s a body must average once body_grace_s have passed since its
                                * headers, or since the end of its last pause (the time the server did
                                * not read, and the client's way back, are not the client's); 0 = 8 KiB/s;
                                * else 408 */
    double body_grace_s;       /* 0 = 10 s */
    size_t max_pipeline_bytes; /* bytes buffered from a client while its request is in flight;
                                * 0 = max_header_bytes + 64 KiB. Beyond: stop reading (backpressure).
                                * Also the unsent answer bytes past which the next pipelined request
                                * waits (a client that sends requests but never reads) */
    size_t read_bytes;         /* the most one read takes from a socket; 0 = 64 KiB (at most that) */
    /* Unsent answer bytes (any answer, streamed or not, the connection closing or not): after
     * write_grace_s (0 = 10 s) the client must take them at min_write_rate (0 = 32 KiB/s) on average,
     * or the connection closes, freeing them (a client that sent Connection: close and never read
     * used to pin its answer for good). A connection counts against max_connections until its
     * socket is closed. */
    double write_grace_s;
    size_t min_write_rate;
    /* HTTP framing is strict as nginx's: obs-fold (a header line continued on the next), a
     * Transfer-Encoding other than "chunked", several Host headers, or none in HTTP/1.1 (unless
     * require_host is false) are 400s: no front end may read a request otherwise than we do. */
    bool require_host;         /* default true */
    /* Host names a request's Host header may carry (port ignored), comma-separated: a page on
     * another site reaching a loopback server by DNS rebinding sends its own name. The bind
     * address is always allowed. NULL or "*": any. Beyond: 403. */
    const char *allowed_hosts;
    bool require_json;         /* POST needs Content-Type: application/json (no cross-site form can send
                                * it without a CORS preflight); beyond: 415 */
    /* Optional: called on the loop thread once a request's headers are complete, before any body byte
     * is read or 100 Continue sent (method, path, query and headers are readable). Returns 0 to go on,
     * or an HTTP status to refuse the request at once with message (OpenAI error shape; 401 gets the
     * type AuthenticationError): the body is never read and the connection closes after the answer.
     * ud is the server's handler ud. */
    int (*on_headers)(const prism_http_req_t *r, void *ud, char *message, size_t message_len);
    /* Optional: the caller's own backpressure, asked for each body in progress, before each read and
     * once it is whole (r: its request; headers and prism_http_req_has_images are readable): a
     * small body arrives whole in one read, and a whole one waits undispatched. While it does not
     * return READ the body waits as that value says (max_pause_s applies: 503); call
     * prism_http_server_resume_bodies once it may return READ again. Loop thread; ud is the
     * handler's. */
    prism_http_body_gate_t (*body_gate)(const prism_http_req_t *r, void *ud);
    /* Optional, with lift_data_urls: the caller's header checks of a lifted image before the body is
     * whole, so an image the handler would refuse stops the upload at its first bytes. Asked on the
     * loop thread as the image's bytes arrive (data[0..len): its first bytes; each ask once they have
     * doubled, from 64), once its string ends (done) or once its base64 is known to be bad, until the
     * answer is not PRISM_HTTP_IMAGE_MORE. index: its place among the body's image URLs (see
     * prism_lift_image_t.ordinal); mime: its data URL's media type. Answers PRISM_HTTP_IMAGE_MORE,
     * PRISM_HTTP_IMAGE_OK, or an HTTP status with message: the request is answered with it at once
     * (the OpenAI error shape), the rest of the upload is read and discarded, and the handler never
     * sees the request. Counting such a refusal is the caller's. ud is the handler's. */
    int (*image_check)(const prism_http_req_t *r, int index, const char *mime, const uint8_t *data, size_t len,
                       bool bad, bool done, char *message, size_t message_len, void *ud);
    /* Optional, with lift_data_urls: a lifted image is whole (its string ended, its base64 is good and
     * image_check, when set, let it pass), while the rest of the body may still be arriving. Called
     * once per image, in body order, on the loop thread; data[0..len) stays the lifter's (read it
     * during the call). ud is the handler's. */
    void (*image_done)(const prism_http_req_t *r, int index, const uint8_t *data, size_t len, void *ud);
    /* Optional, with image_done: a request whose body image_done told of an image will never reach
     * the handler (the client left, or the server refused its body or timed it out), so what the
     * caller started for those images may stop. Once per such request, on the loop thread; r is
     * readable during the call (prism_http_req_id). ud is the handler's. */
    void (*body_gone)(const prism_http_req_t *r, void *ud);
} prism_http_config_t;

prism_http_config_t prism_http_config_default(void);
/* Whether host (a bind address or a Host name) is this machine's loopback: 127.0.0.0/8, ::1,
 * localhost. */
bool prism_http_host_is_loopback(const char *host);
/* The names a loopback server allows by default (with its bind address). */
#define PRISM_HTTP_LOOPBACK_HOSTS "localhost,127.0.0.1,::1"
/* The most one open connection holds (its structures, a request's headers, read and pipelined
 * bytes not parsed yet; a body's bytes are counted in max_body_bytes_total), under cfg's bounds:
 * what a memory plan counts per connection. */
size_t prism_http_conn_bytes(const prism_http_config_t *cfg);

/* Binds and listens; fails with PRISM_EIO when the address cannot be bound. */
int  prism_http_server_start(uv_loop_t *loop, const prism_http_config_t *cfg, prism_http_handler_fn fn,
                             void *ud, prism_http_server_t **out);
/* Closes the listener and every connection through uv_close callbacks (in-flight requests see their
 * abort callback). s is freed once the loop has run the close callbacks: do not use it afterwards. */
void prism_http_server_stop(prism_http_server_t *s);
/* Graceful: stops accepting connections, closes idle keep-alive ones, and ends the others after
 * their current response (Connection: close); prism_http_server_stop still ends the rest. A request
 * whose first bytes had arrived is still handed to the handler: every request it sees after a drain
 * began before it. */
void prism_http_server_drain(prism_http_server_t *s);
int  prism_http_server_port(const prism_http_server_t *s);  /* the bound port (useful with port 0) */
size_t prism_http_server_active_connections(const prism_http_server_t *s);
/* Request body bytes held right now (charged to max_body_bytes_total as they arrive; any thread). */
size_t prism_http_server_body_bytes(const prism_http_server_t *s);
/* Bodies that stopped reading to wait for room (spent budget or body_gate): counted once per
 * pause since start. Any thread. */
uint64_t prism_http_server_pauses(const prism_http_server_t *s);
/* body_gate may let bodies go on: paused ones are asked again (from the loop's next turn). Loop thread. */
void prism_http_server_resume_bodies(prism_http_server_t *s);
/* Requests answered with an error by the server itself, before any handler ran (counters since
 * start; the router exports them as prism:requests_refused_total). Loop thread only. */
typedef struct {
    uint64_t body_too_large;       /* 413: max_body_bytes */
    uint64_t body_bytes_in_flight; /* 503: max_body_bytes_total (from the header, or paused too long) */
    uint64_t body_gate;            /* 503: paused by body_gate longer than max_pause_s */
    uint64_t connections;          /* 503: max_connections */
    uint64_t malformed;            /* 400 / 431 / 417 / 415 */
    uint64_t host;                 /* 403: a Host not in allowed_hosts */
    uint64_t slow_readers;         /* connections closed with answer bytes the client did not take in time */
} prism_http_refusals_t;
void prism_http_server_refusals(const prism_http_server_t *s, prism_http_refusals_t *out);

/* ---- request accessors (valid until the caller's prism_http_req_release) ---- */
const char *prism_http_req_method(const prism_http_req_t *r);   /* "GET", "POST", ... */
const char *prism_http_req_path(const prism_http_req_t *r);     /* without the query string, not decoded */
const char *prism_http_req_query(const prism_http_req_t *r);    /* after '?', may be "" */
/* Case-insensitive; NULL if absent. Repeated headers: the first one. */
const char *prism_http_req_header(const prism_http_req_t *r, const char *name);
/* NUL-terminated for convenience (the NUL is not counted in *len). Never NULL. */
const char *prism_http_req_body(const prism_http_req_t *r, size_t *len);
/* Frees the body early (e.g. once parsed) so a long streaming response does not pin it; with it the
 * lifted images not taken. */
void prism_http_req_drop_body(prism_http_req_t *r);
/* The body has carried a lifted image data URL so far (its bytes, whole or in part, are held). */
bool prism_http_req_has_images(const prism_http_req_t *r);
/* Bytes its lifted images hold that were not taken (their buffers' capacity). */
size_t prism_http_req_image_bytes(const prism_http_req_t *r);
/* With lift_data_urls: hands lifted image i over (see prism_lift_take; *data is the caller's to
 * prism_free, its bytes no longer charged to the server). PRISM_EINVAL when there is no such image
 * or it was taken already. */
int  prism_http_req_take_image(prism_http_req_t *r, int i, uint8_t **data, size_t *len, const char **mime, bool *bad);
/* The same image left where it is (read-only): for work on another thread while the caller holds r
 * and makes no other call on it; take it afterwards on the loop thread (the bytes are the same). */
int  prism_http_req_peek_image(const prism_http_req_t *r, int i, const uint8_t **data, size_t *len, const char **mime,
                               bool *bad);
int  prism_http_req_http_minor(const prism_http_req_t *r);     /* 0 for HTTP/1.0, 1 for HTTP/1.1 */

/* The request's serial and its connection's (each unique since the server started, never 0): a
 * caller's name for a body that may never reach its handler (image_done, body_gone), and for the
 * connection that sent it (pipelined requests share it). */
uint64_t prism_http_req_id(const prism_http_req_t *r);
uint64_t prism_http_req_conn_id(const prism_http_req_t *r);
/* When its first byte came (prism_now_s()): its headers and body took from then to its handler. */
double prism_http_req_began(const prism_http_req_t *r);

void  prism_http_req_set_user(prism_http_req_t *r, void *user);
void *prism_http_req_user(prism_http_req_t *r);

/* Drops the caller's reference (see the ownership rule). The abort callback never fires after it. */
void prism_http_req_release(prism_http_req_t *r);
/* True once the client went away before the response completed. */
bool prism_http_req_aborted(const prism_http_req_t *r);
/* Called at most once, on the loop thread, when the client goes away before the response completed
 * (so upstream work can be cancelled). After it fires, r may only be released. */
void prism_http_req_on_abort(prism_http_req_t *r, void (*cb)(prism_http_req_t *r, void *ud), void *ud);
/* Bytes written for this request that the client has not received yet: queued in the server plus the
 * kernel's unsent / unacknowledged send queue (write backpressure: a streaming producer should pause
 * or drop the client above some threshold). 0 once the connection is gone. */
size_t prism_http_req_pending_bytes(const prism_http_req_t *r);
/* Drops the client (e.g. one that stopped reading a stream): its connection closes from the loop's
 * next turn and the abort callback fires then, never inside this call. No-op once the response is
 * complete or the client is gone. */
void prism_http_req_drop(prism_http_req_t *r);

/* ---- responses ----
 * Exactly one of respond / respond_error / stream_begin..stream_end per request. They may be called
 * from the handler or later from the same loop thread. They return PRISM_EIO once the client is gone
 * and PRISM_EINVAL on misuse (a second response, stream_write before stream_begin). extra_headers is
 * "Name: value\r\n..." (each line CRLF-terminated) or NULL; it must not set Content-Length,
 * Transfer-Encoding or Connection, which the server manages. */
int prism_http_respond(prism_http_req_t *r, int status, const char *content_type, const char *extra_headers,
                       const void *body, size_t len);
/* OpenAI error body {"error":{"message","type","param","code"}}; param/code NULL -> JSON null. */
int prism_http_respond_error(prism_http_req_t *r, int status, const char *type, const char *message,
                             const char *param, const char *code, const char *extra_headers);
/* Chunked transfer encoding (HTTP/1.1); an HTTP/1.0 client gets the raw bytes and a close. */
int prism_http_stream_begin(prism_http_req_t *r, int status, const char *content_type, const char *extra_headers);
int prism_http_stream_write(prism_http_req_t *r, const void *data, size_t len);  /* one chunk; len 0: no-op */
int prism_http_stream_end(prism_http_req_t *r);

const char *prism_http_status_text(int status);  /* "OK", "Not Found", ...; "Unknown" otherwise */

#endif
