/* libFuzzer: the router's HTTP request path — router/http_server.c (llhttp, keep-alive, pipelining,
 * chunked bodies, Expect, upgrade, limits, the API-key check from the headers) with OpenAI JSON bodies
 * parsed by router/openai_req.c — over a real loopback TCP connection.
 *
 * Bodies stream through the data-URL lifter, as in the router: whole images are read as soon as they
 * are in (the router's early encode), and the handler takes every lifted image.
 *
 * Input: [mode] [chunking] [raw bytes a client sends]. mode picks how the handler answers (at once,
 * with an error, streamed, or later from the loop, as the router does), whether the API key is
 * required (checked from the headers), whether lifted images are checked while they stream in (the
 * router's rules: media type, base64, header probe, a pixel limit) and whether the client half-closes;
 * chunking picks how the bytes are split between loop turns. After each input the client goes away and
 * the server must be back to zero connections and zero body bytes (no leak of either), and every
 * request told of an image either reached the handler or was declared gone (body_gone) once: the
 * router aborts the early encodes of a body that never becomes a request on that word. */
#include "fuzz_common.h"
#include "body_lift.h"
#include "http_server.h"
#include "image/data_url.h"
#include "image/image.h"
#include "openai_req.h"
#include "openai_write.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_PENDING 16

static uv_loop_t g_loop;
static prism_http_server_t *g_srv;
static uint8_t g_mode;
static prism_http_req_t *g_pending[MAX_PENDING];  /* answered later from the loop, like the router */

static void on_abort(prism_http_req_t *r, void *ud)
{
    (void)ud;
    for (int i = 0; i < MAX_PENDING; i++)
        if (g_pending[i] == r) {
            g_pending[i] = NULL;
            prism_http_req_release(r);  /* after an abort the request may only be released */
        }
}

static void answer(prism_http_req_t *r, int how)
{
    size_t len;
    const char *body = prism_http_req_body(r, &len);
    const char *path = prism_http_req_path(r);
    bool chat = !strcmp(path, "/v1/chat/completions");
    if (chat || !strcmp(path, "/v1/completions")) {
        prism_oai_request_t q;
        prism_oai_error_t err;
        prism_oai_parse_opts_t o = {.max_images = 4};
        /* the router takes every lifted image it reads; what it leaves is freed with the request */
        for (int i = 0; chat && i < PRISM_LIFT_MAX; i++) {
            uint8_t *img;
            size_t n;
            const char *mime;
            bool bad;
            if (prism_http_req_take_image(r, i, &img, &n, &mime, &bad) == PRISM_OK) prism_free(img);
        }
        if (prism_oai_parse(body, len, chat, &o, &q, &err) != PRISM_OK) {
            prism_http_respond_error(r, err.status, err.type, err.message, err.param[0] ? err.param : NULL, NULL, NULL);
            return;
        }
        if (q.stream || (how & 1)) {
            prism_http_req_drop_body(r);
            if (prism_http_stream_begin(r, 200, "text/event-stream", "Cache-Control: no-cache\r\n") == PRISM_OK) {
                for (int i = 0; i < 1 + (how >> 1); i++)
                    if (prism_http_stream_write(r, "data: {\"x\":1}\n\n", 15) != PRISM_OK) break;
                prism_http_stream_end(r);
            }
        } else {
            prism_http_respond(r, 200, "application/json", "x-request-id: 1\r\n", body, len);
        }
        prism_oai_request_free(&q);
        return;
    }
    if (how & 2) prism_http_respond_error(r, 404, "NotFoundError", path, NULL, NULL, NULL);
    else prism_http_respond(r, 200, "text/plain", NULL, prism_http_req_query(r), strlen(prism_http_req_query(r)));
}

/* Requests told of an image in this input: TOLD, then HANDLED (the handler ran) or GONE (body_gone). */
enum { TOLD = 1, HANDLED, GONE };
#define MAX_TOLD 64
static uint64_t g_told_id[MAX_TOLD];
static uint8_t g_told_state[MAX_TOLD];
static int g_n_told;

static int told_find(uint64_t id)
{
    for (int i = 0; i < g_n_told; i++)
        if (g_told_id[i] == id) return i;
    return -1;
}

static void body_gone(const prism_http_req_t *r, void *ud)
{
    (void)ud;
    int k = told_find(prism_http_req_id(r));
    FUZZ_ASSERT(k >= 0 && g_told_state[k] == TOLD);   /* only a body told of an image, never handled, once */
    g_told_state[k] = GONE;
}

static void on_request(prism_http_req_t *r, void *ud)
{
    (void)ud;
    int k = told_find(prism_http_req_id(r));
    if (k >= 0) {
        FUZZ_ASSERT(g_told_state[k] == TOLD);
        g_told_state[k] = HANDLED;
    }
    (void)prism_http_req_header(r, "Authorization");
    (void)prism_http_req_header(r, "content-type");
    if (g_mode & 0x10) {  /* answer later, from the loop */
        for (int i = 0; i < MAX_PENDING; i++)
            if (!g_pending[i]) {
                g_pending[i] = r;
                prism_http_req_on_abort(r, on_abort, NULL);
                return;
            }
    }
    answer(r, g_mode & 7);
    prism_http_req_release(r);
}

static void answer_pending(void)
{
    for (int i = 0; i < MAX_PENDING; i++) {
        prism_http_req_t *r = g_pending[i];
        if (!r) continue;
        g_pending[i] = NULL;
        if (!prism_http_req_aborted(r)) answer(r, g_mode & 7);
        prism_http_req_release(r);
    }
}

/* The router's API key check, from the headers (router/api.c router_on_headers): mode bit 0x40
 * turns it on, so the 401 path (answered before the body) is fuzzed too. */
static int on_headers(const prism_http_req_t *r, void *ud, char *msg, size_t n)
{
    (void)ud;
    if (!(g_mode & 0x40) || !strcmp(prism_http_req_path(r), "/health")) return 0;
    const char *a = prism_http_req_header(r, "authorization");
    if (a && !strncmp(a, "Bearer ", 7) && prism_ct_equal(a + 7, strlen(a + 7), "k", 1)) return 0;
    snprintf(msg, n, "Invalid or missing API key.");
    return 401;
}

/* The router's early image check (router/prompt.c router_image_check on a prefix): mode bit 0x08
 * turns it on. Only verdicts more bytes cannot change are final. */
static int image_check(const prism_http_req_t *r, int index, const char *mime, const uint8_t *data, size_t len,
                       bool bad, bool done, char *msg, size_t n, void *ud)
{
    (void)r;
    (void)ud;
    FUZZ_ASSERT(mime && (len == 0 || data) && index >= 0);
    if (!(g_mode & 0x08)) return PRISM_HTTP_IMAGE_OK;
    if (!prism_data_url_mime_is_image(mime, strlen(mime)) || bad) {
        snprintf(msg, n, "Image %d: refused.", index);
        return 400;
    }
    if (!done && len == 0) return PRISM_HTTP_IMAGE_MORE;
    prism_image_info_t info;
    int rc = data ? prism_image_probe(data, len, &info) : PRISM_ECORRUPT;
    if (rc == PRISM_ECORRUPT && !done) return PRISM_HTTP_IMAGE_MORE;
    if (rc != PRISM_OK || (uint64_t)info.width * (uint64_t)info.height > 1u << 20) {
        snprintf(msg, n, "Image %d: not an image, or too large.", index);
        return 400;
    }
    return PRISM_HTTP_IMAGE_OK;
}

/* The router's early encode reads the whole image while the body goes on: touch both ends. */
static volatile uint8_t g_sink;
static void image_done(const prism_http_req_t *r, int index, const uint8_t *data, size_t len, void *ud)
{
    (void)ud;
    FUZZ_ASSERT(data && len > 0 && index >= 0);
    g_sink = data[0] ^ data[len - 1];
    uint64_t id = prism_http_req_id(r);
    FUZZ_ASSERT(id != 0);
    int k = told_find(id);
    if (k < 0 && g_n_told < MAX_TOLD) {
        g_told_id[g_n_told] = id;
        g_told_state[g_n_told++] = TOLD;
    } else if (k >= 0) {
        FUZZ_ASSERT(g_told_state[k] == TOLD);   /* no image after the request was handled or gone */
    }
}

static void init_server(void)
{
    fuzz_init_once();
    uv_loop_init(&g_loop);
    prism_http_config_t c = prism_http_config_default();
    c.port = 0;
    c.max_header_bytes = 8 << 10;
    c.max_body_bytes = 64 << 10;
    c.max_body_bytes_total = 96 << 10;
    c.max_connections = 4;
    c.on_headers = on_headers;
    c.lift_data_urls = true;
    c.image_check = image_check;
    c.image_done = image_done;
    c.body_gone = body_gone;
    if (prism_http_server_start(&g_loop, &c, on_request, NULL, &g_srv) != PRISM_OK) abort();
}

static int client_connect(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)prism_http_server_port(g_srv)),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno != EINPROGRESS) abort();
    return fd;
}

/* One loop turn: the server runs what is ready; the client drains what the server wrote. */
static bool turn(int fd)
{
    uv_run(&g_loop, UV_RUN_NOWAIT);
    answer_pending();
    char buf[65536];
    bool eof = false;
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n > 0) continue;
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) eof = true;
        break;
    }
    return eof;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!g_srv) init_server();
    if (size < 2) return 0;
    g_mode = data[0];
    g_n_told = 0;
    size_t chunk = 1 + (size_t)data[1] * 8;
    data += 2, size -= 2;
    int fd = client_connect();
    bool eof = false;
    size_t off = 0;
    for (int spins = 0; off < size && !eof && spins < 4096; spins++) {
        size_t n = PRISM_MIN(chunk, size - off);
        ssize_t w = send(fd, data + off, n, MSG_NOSIGNAL);
        if (w > 0) off += (size_t)w;
        else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) break;
        eof = turn(fd);
    }
    if (g_mode & 0x20) shutdown(fd, SHUT_WR);
    for (int i = 0; i < 64 && !eof; i++) eof = turn(fd);
    close(fd);
    /* the client is gone: every connection and every body byte must be released */
    for (int i = 0; i < 1000 && prism_http_server_active_connections(g_srv) > 0; i++) {
        uv_run(&g_loop, UV_RUN_NOWAIT);
        answer_pending();
        if (i > 100) usleep(100);
    }
    FUZZ_ASSERT(prism_http_server_active_connections(g_srv) == 0);
    for (int i = 0; i < g_n_told; i++) FUZZ_ASSERT(g_told_state[i] != TOLD);   /* handled, or declared gone */
    return 0;
}
