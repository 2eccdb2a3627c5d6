/* libFuzzer: the image-URL rules of router/fetch_policy.c — URLs through libcurl's parser and our
 * checks, redirects resolved against them, file:// paths opened beneath a directory, CIDR networks and
 * the address classes.
 *
 * The first input byte picks what the rest is:
 *   0: a URL ("@" right after "file://" stands for the allowed directory);
 *   1: a URL, a NUL, a redirect's Location;
 *   2: a CIDR network, a NUL, 16 address bytes;
 *   3: 4 IPv4 address bytes (and more: ignored).
 * Invariants: an accepted URL has a key of at most PRISM_FETCH_MAX_URL bytes with an http, https or
 * file scheme, the key is accepted again as itself, and its host is in the allowlist; a redirect never
 * leads to file://; a file that opens is a regular file beneath the allowed directory (its path read
 * back from /proc/self/fd), and the O_NOFOLLOW walk opens a file only where openat2 opens the same
 * one; a network contains its own address, and an allowed network allows what it contains; an IPv4
 * address is judged alike in every IPv6 form that carries it. */
#define _GNU_SOURCE
#include "fuzz_common.h"
#include "fetch_policy.h"

#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

static prism_fetch_policy_t P;
static char dir[PATH_MAX];    /* the allowed directory (real path) */
static char top[PATH_MAX];

static void mkfile(const char *rel, const char *text)
{
    char p[PATH_MAX * 2];
    snprintf(p, sizeof p, "%s/%s", top, rel);
    FILE *f = fopen(p, "w");
    FUZZ_ASSERT(f);
    fputs(text, f);
    fclose(f);
}

static void cleanup(void)
{
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", top);
    if (system(cmd)) {}
}

static void init(void)
{
    static int done;
    if (done) return;
    done = 1;
    fuzz_init_once();
    snprintf(top, sizeof top, "/tmp/prism-fuzz-fetch-XXXXXX");
    FUZZ_ASSERT(mkdtemp(top));
    atexit(cleanup);
    char p[PATH_MAX * 2];
    const char *dirs[] = {"media", "media/sub", "secret"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", top, dirs[i]);
        FUZZ_ASSERT(mkdir(p, 0755) == 0);
    }
    mkfile("media/a.jpg", "a");
    mkfile("media/sub/b.jpg", "b");
    mkfile("secret/s", "s");
    snprintf(p, sizeof p, "%s/media/up", top);
    FUZZ_ASSERT(symlink("../secret", p) == 0);
    snprintf(p, sizeof p, "%s/media/in.jpg", top);
    FUZZ_ASSERT(symlink("a.jpg", p) == 0);
    snprintf(p, sizeof p, "%s/media/abs", top);
    FUZZ_ASSERT(symlink("/etc/passwd", p) == 0);
    snprintf(p, sizeof p, "%s/media", top);
    FUZZ_ASSERT(realpath(p, dir));
    const char *nets[] = {"10.9.0.0/24", "fd00::/8"};
    const char *domains[] = {"a.test", "[::1]", "198.51.100.2"};
    char why[256];
    FUZZ_ASSERT(prism_fetch_policy_init(&P, nets, 2, domains, 3, dir, why, sizeof why) == PRISM_OK);
}

static bool host_allowed(const prism_fetch_url_t *u)
{
    char *host = NULL;
    if (curl_url_get(u->u, CURLUPART_HOST, &host, CURLU_PUNYCODE) != CURLUE_OK) return false;
    char norm[300];
    size_t n = strlen(host);
    const char *h = host;
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') h++, n -= 2;
    if (n && h[n - 1] == '.') n--;
    bool ok = false;
    if (n < sizeof norm) {
        for (size_t i = 0; i < n; i++) norm[i] = (char)((h[i] >= 'A' && h[i] <= 'Z') ? h[i] + 32 : h[i]);
        norm[n] = 0;
        for (int i = 0; i < P.n_domains; i++) ok |= !strcmp(P.domains[i], norm);
    }
    curl_free(host);
    return ok;
}

static void check_beneath(int fd)
{
    char link[64], target[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    FUZZ_ASSERT(n > 0);
    target[n] = 0;
    size_t dl = strlen(dir);
    FUZZ_ASSERT((size_t)n > dl + 1 && !memcmp(target, dir, dl) && target[dl] == '/');
    struct stat st;
    FUZZ_ASSERT(fstat(fd, &st) == 0 && S_ISREG(st.st_mode));
}

static void check_accepted(const prism_fetch_url_t *u, bool from_redirect)
{
    FUZZ_ASSERT(u->u && u->key);
    FUZZ_ASSERT(strlen(u->key) <= PRISM_FETCH_MAX_URL);
    bool file = !strncmp(u->key, "file:", 5);
    FUZZ_ASSERT(file == u->is_file);
    FUZZ_ASSERT(file || !strncmp(u->key, "http://", 7) || !strncmp(u->key, "https://", 8));
    if (from_redirect) FUZZ_ASSERT(!file);
    if (!file) FUZZ_ASSERT(host_allowed(u));
    /* the key is a URL the rules accept as itself */
    prism_fetch_url_t again;
    FUZZ_ASSERT(prism_fetch_policy_url(&P, u->key, strlen(u->key), &again) == PRISM_FETCH_OK);
    FUZZ_ASSERT(!strcmp(again.key, u->key));
    prism_fetch_url_free(&again);
    if (!file) return;
    int fd = -1, fd2 = -1;
    uint64_t size = 0;
    prism_fetch_reason_t r = prism_fetch_policy_open_local(&P, u, &fd, &size);
    P.no_openat2 = true;
    prism_fetch_reason_t r2 = prism_fetch_policy_open_local(&P, u, &fd2, &size);
    P.no_openat2 = false;
    if (r == PRISM_FETCH_OK) check_beneath(fd);
    if (r2 == PRISM_FETCH_OK) {
        check_beneath(fd2);
        /* the walk is stricter (no ".." at all), never looser */
        FUZZ_ASSERT(r == PRISM_FETCH_OK);
        struct stat a, b;
        FUZZ_ASSERT(fstat(fd, &a) == 0 && fstat(fd2, &b) == 0 && a.st_ino == b.st_ino && a.st_dev == b.st_dev);
    }
    if (fd >= 0) close(fd);
    if (fd2 >= 0) close(fd2);
}

/* "file://@" -> "file://<dir>" */
static char *expand(const uint8_t *d, size_t n, size_t *out_n)
{
    size_t dl = strlen(dir), at = 0;
    for (size_t i = 7; i < n; i++) at += d[i] == '@' && !memcmp(d + i - 7, "file://", 7);
    char *s = malloc(n + at * dl + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (d[i] == '@' && i >= 7 && !memcmp(d + i - 7, "file://", 7)) {
            memcpy(s + o, dir, dl);
            o += dl;
        } else {
            s[o++] = (char)d[i];
        }
    }
    s[o] = 0;
    *out_n = o;
    return s;
}

static prism_fetch_reason_t classify_v4(const uint8_t v4[4], const uint8_t pre[], size_t pn, size_t at)
{
    prism_ip_t ip = {{0}};
    memcpy(ip.b, pre, pn);
    memcpy(ip.b + at, v4, 4);
    return prism_ip_classify(&ip);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    init();
    if (size < 1) return 0;
    int mode = data[0] & 3;
    data++;
    size--;
    if (mode == 0 || mode == 1) {
        const uint8_t *nul = mode == 1 ? memchr(data, 0, size) : NULL;
        size_t un = nul ? (size_t)(nul - data) : size;
        size_t n;
        char *url = expand(data, un, &n);
        prism_fetch_url_t u;
        prism_fetch_reason_t r = prism_fetch_policy_url(&P, url, n, &u);
        FUZZ_ASSERT(r < PRISM_FETCH_REASON_COUNT && !prism_fetch_reason_is_address(r));
        if (r == PRISM_FETCH_OK) {
            check_accepted(&u, false);
            if (nul) {
                prism_fetch_url_t to;
                const char *loc = (const char *)nul + 1;
                size_t ln = size - un - 1;
                if (prism_fetch_policy_redirect(&P, &u, loc, ln, &to) == PRISM_FETCH_OK) check_accepted(&to, true);
                else FUZZ_ASSERT(!to.u && !to.key);
                prism_fetch_url_free(&to);
            }
        } else {
            FUZZ_ASSERT(!u.u && !u.key);
        }
        prism_fetch_url_free(&u);
        free(url);
    } else if (mode == 2) {
        const uint8_t *nul = memchr(data, 0, size);
        if (!nul || (size_t)(data + size - nul - 1) < 16) return 0;
        prism_cidr_t c;
        if (prism_cidr_parse((const char *)data, (size_t)(nul - data), &c) != PRISM_OK) return 0;
        FUZZ_ASSERT(c.prefix >= 0 && c.prefix <= 128);
        FUZZ_ASSERT(prism_cidr_contains(&c, &c.net));
        prism_ip_t ip;
        memcpy(ip.b, nul + 1, 16);
        prism_fetch_policy_t q = {.n_nets = 1, .local_dirfd = -1};
        q.nets[0] = c;
        prism_fetch_reason_t r = prism_fetch_policy_ip(&q, &ip);
        if (prism_cidr_contains(&c, &ip)) FUZZ_ASSERT(r == PRISM_FETCH_OK);
        else FUZZ_ASSERT(r == prism_ip_classify(&ip) || r == PRISM_FETCH_OK);   /* OK: by an IPv4 address it carries */
        char txt[64];
        prism_ip_format(&ip, txt, sizeof txt);
        prism_ip_t back;
        FUZZ_ASSERT(prism_ip_parse(txt, strlen(txt), &back) == PRISM_OK && !memcmp(back.b, ip.b, 16));
    } else {
        if (size < 4) return 0;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        static const uint8_t nat64[12] = {0, 0x64, 0xff, 0x9b};
        static const uint8_t six2four[2] = {0x20, 0x02};
        prism_fetch_reason_t a = classify_v4(data, mapped, 12, 12);
        FUZZ_ASSERT(classify_v4(data, nat64, 12, 12) == a);
        FUZZ_ASSERT(classify_v4(data, six2four, 2, 2) == a);
        FUZZ_ASSERT(a == PRISM_FETCH_OK || prism_fetch_reason_is_address(a));
    }
    return 0;
}
