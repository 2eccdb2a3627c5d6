/* fetch_policy: the URL and address rules of image fetching (see fetch_policy.h). */
#define _GNU_SOURCE
#include "fetch_policy.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

const char *const prism_fetch_reason_names[PRISM_FETCH_REASON_COUNT] = {
    [PRISM_FETCH_OK] = "ok",
    [PRISM_FETCH_URL] = "url",
    [PRISM_FETCH_SCHEME] = "scheme",
    [PRISM_FETCH_DOMAIN] = "domain",
    [PRISM_FETCH_ADDR_LOOPBACK] = "loopback",
    [PRISM_FETCH_ADDR_PRIVATE] = "private",
    [PRISM_FETCH_ADDR_LINK_LOCAL] = "link_local",
    [PRISM_FETCH_ADDR_SHARED] = "shared",
    [PRISM_FETCH_ADDR_UNIQUE_LOCAL] = "unique_local",
    [PRISM_FETCH_ADDR_MULTICAST] = "multicast",
    [PRISM_FETCH_ADDR_UNSPECIFIED] = "unspecified",
    [PRISM_FETCH_ADDR_METADATA] = "metadata",
    [PRISM_FETCH_ADDR_RESERVED] = "reserved",
    [PRISM_FETCH_FILE_DISABLED] = "file_disabled",
    [PRISM_FETCH_FILE_OUTSIDE] = "file_outside",
    [PRISM_FETCH_FILE_SYMLINK] = "file_symlink",
    [PRISM_FETCH_FILE_NOT_FOUND] = "file_not_found",
    [PRISM_FETCH_FILE_NOT_REGULAR] = "file_not_regular",
    [PRISM_FETCH_DNS] = "dns",
    [PRISM_FETCH_CONNECT] = "connect",
    [PRISM_FETCH_CONNECT_TIMEOUT] = "connect_timeout",
    [PRISM_FETCH_TLS] = "tls",
    [PRISM_FETCH_TIMEOUT] = "timeout",
    [PRISM_FETCH_TOO_SLOW] = "too_slow",
    [PRISM_FETCH_TOO_LARGE_DECLARED] = "too_large_declared",
    [PRISM_FETCH_TOO_LARGE] = "too_large",
    [PRISM_FETCH_REDIRECTS] = "redirects",
    [PRISM_FETCH_HTTP_STATUS] = "http_status",
    [PRISM_FETCH_TRUNCATED] = "truncated",
    [PRISM_FETCH_NETWORK] = "network",
    [PRISM_FETCH_BUSY] = "busy",
    [PRISM_FETCH_NOMEM] = "nomem",
};

static const char *const reason_messages[PRISM_FETCH_REASON_COUNT] = {
    [PRISM_FETCH_OK] = "image fetched",
    [PRISM_FETCH_URL] = "image URL refused: malformed, too long, or carrying credentials",
    [PRISM_FETCH_SCHEME] = "image URL refused: only http and https URLs are fetched",
    [PRISM_FETCH_DOMAIN] = "image URL refused: its host is not one of the allowed media domains",
    [PRISM_FETCH_ADDR_LOOPBACK] = "image URL refused: its host resolves to a loopback address",
    [PRISM_FETCH_ADDR_PRIVATE] = "image URL refused: its host resolves to a private address",
    [PRISM_FETCH_ADDR_LINK_LOCAL] = "image URL refused: its host resolves to a link-local address",
    [PRISM_FETCH_ADDR_SHARED] = "image URL refused: its host resolves to a shared (carrier-grade NAT) address",
    [PRISM_FETCH_ADDR_UNIQUE_LOCAL] = "image URL refused: its host resolves to a unique-local address",
    [PRISM_FETCH_ADDR_MULTICAST] = "image URL refused: its host resolves to a multicast address",
    [PRISM_FETCH_ADDR_UNSPECIFIED] = "image URL refused: its host resolves to an unspecified address",
    [PRISM_FETCH_ADDR_METADATA] = "image URL refused: its host resolves to a cloud metadata address",
    [PRISM_FETCH_ADDR_RESERVED] = "image URL refused: its host resolves to a reserved address",
    [PRISM_FETCH_FILE_DISABLED] = "image URL refused: file URLs are not allowed on this server",
    [PRISM_FETCH_FILE_OUTSIDE] = "image URL refused: the file is outside the allowed local media directory",
    [PRISM_FETCH_FILE_SYMLINK] = "image URL refused: the file's path goes through a symbolic link",
    [PRISM_FETCH_FILE_NOT_FOUND] = "image file not found or not readable",
    [PRISM_FETCH_FILE_NOT_REGULAR] = "image URL refused: not a regular file",
    [PRISM_FETCH_DNS] = "image URL could not be fetched: its host name does not resolve",
    [PRISM_FETCH_CONNECT] = "image URL could not be fetched: the connection failed",
    [PRISM_FETCH_CONNECT_TIMEOUT] = "image URL could not be fetched: connecting timed out",
    [PRISM_FETCH_TLS] = "image URL could not be fetched: TLS handshake or certificate verification failed",
    [PRISM_FETCH_TIMEOUT] = "image URL could not be fetched: the download took too long",
    [PRISM_FETCH_TOO_SLOW] = "image URL could not be fetched: the download was slower than the minimum rate",
    [PRISM_FETCH_TOO_LARGE_DECLARED] = "image URL refused: its declared size exceeds the image size limit",
    [PRISM_FETCH_TOO_LARGE] = "image download cut off: it exceeds the image size limit",
    [PRISM_FETCH_REDIRECTS] = "image URL could not be fetched: too many redirects, or a malformed one",
    [PRISM_FETCH_HTTP_STATUS] = "image URL could not be fetched: the server answered with an error status",
    [PRISM_FETCH_TRUNCATED] = "image URL could not be fetched: the body ended before its declared length",
    [PRISM_FETCH_NETWORK] = "image URL could not be fetched: network error",
    [PRISM_FETCH_BUSY] = "too many image downloads waiting; try again later",
    [PRISM_FETCH_NOMEM] = "out of memory for the image download",
};

const char *prism_fetch_reason_message(prism_fetch_reason_t r)
{
    return (unsigned)r < PRISM_FETCH_REASON_COUNT ? reason_messages[r] : "image fetch failed";
}

int prism_fetch_reason_http_status(prism_fetch_reason_t r)
{
    if (r == PRISM_FETCH_OK) return 200;
    return r == PRISM_FETCH_BUSY || r == PRISM_FETCH_NOMEM ? 503 : 400;
}

bool prism_fetch_reason_is_address(prism_fetch_reason_t r)
{
    return r >= PRISM_FETCH_ADDR_LOOPBACK && r <= PRISM_FETCH_ADDR_RESERVED;
}

/* ---- addresses ---- */

static void ip_from_v4(prism_ip_t *ip, const uint8_t v4[4])
{
    memset(ip->b, 0, 10);
    ip->b[10] = ip->b[11] = 0xff;
    memcpy(ip->b + 12, v4, 4);
}

static bool ip_is_v4(const prism_ip_t *ip)
{
    static const uint8_t pre[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return !memcmp(ip->b, pre, 12);
}

/* The IPv4 address an IPv6 address carries for translation or tunnelling (NAT64 64:ff9b::/96, 6to4
 * 2002::/16): a connection to it reaches that IPv4 host. False when it carries none. */
static bool ip_embedded_v4(const prism_ip_t *ip, uint8_t v4[4])
{
    static const uint8_t nat64[12] = {0, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0};
    if (!memcmp(ip->b, nat64, 12)) {
        memcpy(v4, ip->b + 12, 4);
        return true;
    }
    if (ip->b[0] == 0x20 && ip->b[1] == 0x02) {
        memcpy(v4, ip->b + 2, 4);
        return true;
    }
    return false;
}

int prism_ip_parse(const char *s, size_t len, prism_ip_t *out)
{
    char buf[INET6_ADDRSTRLEN + 1];
    if (len == 0 || len >= sizeof buf || memchr(s, 0, len)) return PRISM_EINVAL;
    memcpy(buf, s, len);
    buf[len] = 0;
    uint8_t v4[4];
    if (inet_pton(AF_INET, buf, v4) == 1) {
        ip_from_v4(out, v4);
        return PRISM_OK;
    }
    if (inet_pton(AF_INET6, buf, out->b) == 1) return PRISM_OK;
    return PRISM_EINVAL;
}

int prism_ip_from_sockaddr(const struct sockaddr *sa, size_t len, prism_ip_t *out)
{
    if (!sa || len < sizeof(sa_family_t)) return PRISM_EINVAL;
    if (sa->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in in;
        memcpy(&in, sa, sizeof in);
        ip_from_v4(out, (const uint8_t *)&in.sin_addr.s_addr);
        return PRISM_OK;
    }
    if (sa->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, sa, sizeof in6);
        memcpy(out->b, in6.sin6_addr.s6_addr, 16);
        return PRISM_OK;
    }
    return PRISM_EINVAL;
}

void prism_ip_format(const prism_ip_t *ip, char *out, size_t n)
{
    char buf[INET6_ADDRSTRLEN];
    const char *s = ip_is_v4(ip) ? inet_ntop(AF_INET, ip->b + 12, buf, sizeof buf)
                                 : inet_ntop(AF_INET6, ip->b, buf, sizeof buf);
    snprintf(out, n, "%s", s ? s : "?");
}

static prism_fetch_reason_t classify_v4(const uint8_t a[4])
{
    if (a[0] == 0) return PRISM_FETCH_ADDR_UNSPECIFIED;                   /* 0/8 "this network" */
    if (a[0] == 10) return PRISM_FETCH_ADDR_PRIVATE;
    if (a[0] == 100 && (a[1] & 0xc0) == 64) {                             /* 100.64/10 */
        if (a[1] == 100 && a[2] == 100 && a[3] == 200) return PRISM_FETCH_ADDR_METADATA;  /* Alibaba Cloud */
        return PRISM_FETCH_ADDR_SHARED;
    }
    if (a[0] == 127) return PRISM_FETCH_ADDR_LOOPBACK;
    if (a[0] == 169 && a[1] == 254) {
        if (a[2] == 169 && a[3] == 254) return PRISM_FETCH_ADDR_METADATA;  /* AWS, GCP, Azure, OCI... */
        return PRISM_FETCH_ADDR_LINK_LOCAL;
    }
    if (a[0] == 172 && (a[1] & 0xf0) == 16) return PRISM_FETCH_ADDR_PRIVATE;
    if (a[0] == 192 && a[1] == 0 && a[2] == 0) return PRISM_FETCH_ADDR_RESERVED;
    if (a[0] == 192 && a[1] == 168) return PRISM_FETCH_ADDR_PRIVATE;
    if (a[0] == 198 && (a[1] & 0xfe) == 18) return PRISM_FETCH_ADDR_RESERVED;  /* benchmarking */
    if ((a[0] & 0xf0) == 224) return PRISM_FETCH_ADDR_MULTICAST;
    if ((a[0] & 0xf0) == 240) return PRISM_FETCH_ADDR_RESERVED;            /* broadcast included */
    return PRISM_FETCH_OK;
}

prism_fetch_reason_t prism_ip_classify(const prism_ip_t *ip)
{
    const uint8_t *b = ip->b;
    if (ip_is_v4(ip)) return classify_v4(b + 12);
    static const uint8_t zero[16];
    if (!memcmp(b, zero, 16)) return PRISM_FETCH_ADDR_UNSPECIFIED;
    if (!memcmp(b, zero, 15) && b[15] == 1) return PRISM_FETCH_ADDR_LOOPBACK;
    if (b[0] == 0xff) return PRISM_FETCH_ADDR_MULTICAST;
    if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80) return PRISM_FETCH_ADDR_LINK_LOCAL;
    if (b[0] == 0xfe && (b[1] & 0xc0) == 0xc0) return PRISM_FETCH_ADDR_PRIVATE;   /* site-local (deprecated) */
    if ((b[0] & 0xfe) == 0xfc) {
        static const uint8_t aws[16] = {0xfd, 0, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54};
        return !memcmp(b, aws, 16) ? PRISM_FETCH_ADDR_METADATA : PRISM_FETCH_ADDR_UNIQUE_LOCAL;
    }
    uint8_t v4[4];
    if (ip_embedded_v4(ip, v4)) return classify_v4(v4);
    static const uint8_t nat64_local[6] = {0, 0x64, 0xff, 0x9b, 0, 1};
    if (!memcmp(b, nat64_local, 6)) return PRISM_FETCH_ADDR_PRIVATE;          /* 64:ff9b:1::/48 */
    if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0 && b[3] == 0) return PRISM_FETCH_ADDR_RESERVED;  /* Teredo */
    if (b[0] == 0x01 && !memcmp(b + 1, zero, 7)) return PRISM_FETCH_ADDR_RESERVED;  /* 100::/64 discard */
    if (b[0] == 0) return PRISM_FETCH_ADDR_RESERVED;   /* the rest of ::/8, IPv4-compatible included */
    return PRISM_FETCH_OK;
}

int prism_cidr_parse(const char *s, size_t len, prism_cidr_t *out)
{
    const char *slash = memchr(s, '/', len);
    size_t alen = slash ? (size_t)(slash - s) : len;
    prism_ip_t ip;
    if (prism_ip_parse(s, alen, &ip) != PRISM_OK) return PRISM_EINVAL;
    bool v4 = ip_is_v4(&ip) && !memchr(s, ':', alen);
    int max = v4 ? 32 : 128, prefix = max;
    if (slash) {
        const char *d = slash + 1, *end = s + len;
        if (d == end || end - d > 3) return PRISM_EINVAL;
        prefix = 0;
        for (; d < end; d++) {
            if (*d < '0' || *d > '9') return PRISM_EINVAL;
            prefix = prefix * 10 + (*d - '0');
        }
        if (prefix > max) return PRISM_EINVAL;
    }
    if (v4) prefix += 96;
    out->prefix = prefix;
    out->net = ip;
    for (int i = 0; i < 16; i++) {
        int bits = prefix - i * 8;
        uint8_t mask = bits >= 8 ? 0xff : bits <= 0 ? 0 : (uint8_t)(0xff << (8 - bits));
        out->net.b[i] &= mask;
    }
    return PRISM_OK;
}

bool prism_cidr_contains(const prism_cidr_t *c, const prism_ip_t *ip)
{
    int full = c->prefix / 8, rest = c->prefix % 8;
    if (memcmp(c->net.b, ip->b, (size_t)full)) return false;
    if (!rest) return true;
    uint8_t mask = (uint8_t)(0xff << (8 - rest));
    return (ip->b[full] & mask) == c->net.b[full];
}

prism_fetch_reason_t prism_fetch_policy_ip(const prism_fetch_policy_t *p, const prism_ip_t *ip)
{
    prism_fetch_reason_t cls = prism_ip_classify(ip);
    if (cls == PRISM_FETCH_OK) return PRISM_FETCH_OK;
    prism_ip_t inner;
    uint8_t v4[4];
    bool has_inner = ip_embedded_v4(ip, v4);
    if (has_inner) ip_from_v4(&inner, v4);
    for (int i = 0; i < p->n_nets; i++)
        if (prism_cidr_contains(&p->nets[i], ip) || (has_inner && prism_cidr_contains(&p->nets[i], &inner)))
            return PRISM_FETCH_OK;
    return cls;
}

prism_fetch_reason_t prism_fetch_policy_addr(const prism_fetch_policy_t *p, const struct sockaddr *sa, size_t len)
{
    prism_ip_t ip;
    if (prism_ip_from_sockaddr(sa, len, &ip) != PRISM_OK) return PRISM_FETCH_ADDR_RESERVED;  /* not IP: never */
    return prism_fetch_policy_ip(p, &ip);
}

/* ---- the policy ---- */

/* Lower case, brackets of an IPv6 literal and one trailing dot dropped; false when it does not fit. */
static bool host_norm(const char *h, size_t n, char out[PRISM_FETCH_MAX_HOST + 1])
{
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') h++, n -= 2;
    if (n && h[n - 1] == '.') n--;
    if (n == 0 || n > PRISM_FETCH_MAX_HOST || memchr(h, 0, n)) return false;
    for (size_t i = 0; i < n; i++) out[i] = (char)tolower((unsigned char)h[i]);
    out[n] = 0;
    return true;
}

int prism_fetch_policy_init(prism_fetch_policy_t *p, const char *const *nets, int n_nets,
                            const char *const *domains, int n_domains, const char *local_dir,
                            char *why, size_t why_n)
{
    memset(p, 0, sizeof *p);
    p->local_dirfd = -1;
    if (n_nets > PRISM_FETCH_MAX_NETS || n_domains > PRISM_FETCH_MAX_DOMAINS) {
        snprintf(why, why_n, "at most %d allowed networks and %d allowed domains", PRISM_FETCH_MAX_NETS,
                 PRISM_FETCH_MAX_DOMAINS);
        return PRISM_EINVAL;
    }
    for (int i = 0; i < n_nets; i++) {
        if (prism_cidr_parse(nets[i], strlen(nets[i]), &p->nets[p->n_nets]) != PRISM_OK) {
            snprintf(why, why_n, "allowed media network '%s' is not an address or CIDR network", nets[i]);
            return PRISM_EINVAL;
        }
        p->n_nets++;
    }
    for (int i = 0; i < n_domains; i++) {
        if (!host_norm(domains[i], strlen(domains[i]), p->domains[p->n_domains])) {
            snprintf(why, why_n, "allowed media domain '%s' is not a host name", domains[i]);
            return PRISM_EINVAL;
        }
        p->n_domains++;
    }
    if (local_dir && *local_dir) {
        char real[PATH_MAX];
        if (local_dir[0] != '/' || !realpath(local_dir, real)) {
            snprintf(why, why_n, "allowed local media path '%s' is not an absolute path to a directory", local_dir);
            return PRISM_EINVAL;
        }
        p->local_dirfd = open(real, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (p->local_dirfd < 0 || strlen(real) >= sizeof p->local_dir || strlen(local_dir) >= sizeof p->local_dir_given) {
            snprintf(why, why_n, "allowed local media path '%s' cannot be opened as a directory: %s", local_dir,
                     strerror(errno));
            prism_fetch_policy_free(p);
            return PRISM_EINVAL;
        }
        snprintf(p->local_dir, sizeof p->local_dir, "%s", real);
        snprintf(p->local_dir_given, sizeof p->local_dir_given, "%s", local_dir);
        for (size_t n = strlen(p->local_dir_given); n > 1 && p->local_dir_given[n - 1] == '/'; n--)
            p->local_dir_given[n - 1] = 0;
    }
    return PRISM_OK;
}

void prism_fetch_policy_free(prism_fetch_policy_t *p)
{
    if (p->local_dirfd >= 0) close(p->local_dirfd);
    p->local_dirfd = -1;
}

void prism_fetch_url_free(prism_fetch_url_t *u)
{
    if (u->u) curl_url_cleanup(u->u);
    if (u->key) curl_free(u->key);
    memset(u, 0, sizeof *u);
}

static prism_fetch_reason_t from_uc(CURLUcode rc, prism_fetch_reason_t otherwise)
{
    if (rc == CURLUE_OUT_OF_MEMORY) return PRISM_FETCH_NOMEM;
    if (rc == CURLUE_UNSUPPORTED_SCHEME) return PRISM_FETCH_SCHEME;   /* well formed, not one curl speaks */
    return otherwise;
}

/* The cache key of a parsed URL: its spelling without the default port, host in lower case. */
static CURLUcode make_key(CURLU *u, char **out)
{
    char *key = NULL;
    CURLUcode rc = curl_url_get(u, CURLUPART_URL, &key, CURLU_NO_DEFAULT_PORT);
    if (rc != CURLUE_OK) return rc;
    if (strlen(key) > PRISM_FETCH_MAX_URL) {
        curl_free(key);
        return CURLUE_MALFORMED_INPUT;
    }
    /* host names are case-blind (libcurl keeps their case): one spelling per host in the key */
    char *h = strstr(key, "://");
    for (h = h ? h + 3 : key + strlen(key); *h && *h != '/'; h++) *h = (char)tolower((unsigned char)*h);
    *out = key;
    return CURLUE_OK;
}

/* Rules 2-3 on a parsed URL; fills out (taking u) on OK, frees u otherwise. */
static prism_fetch_reason_t check_parsed(const prism_fetch_policy_t *p, CURLU *u, bool allow_file,
                                         prism_fetch_url_t *out)
{
    prism_fetch_reason_t why = PRISM_FETCH_OK;
    char *scheme = NULL, *cred = NULL, *host = NULL;
    bool is_file = false;
    if (curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK) {
        why = PRISM_FETCH_URL;
        goto done;
    }
    /* credentials would be sent to whatever host the URL names; an image URL has no use for them */
    if (curl_url_get(u, CURLUPART_USER, &cred, 0) == CURLUE_OK ||
        curl_url_get(u, CURLUPART_PASSWORD, &cred, 0) == CURLUE_OK ||
        curl_url_get(u, CURLUPART_OPTIONS, &cred, 0) == CURLUE_OK) {
        why = PRISM_FETCH_URL;
        goto done;
    }
    if (!strcmp(scheme, "http") || !strcmp(scheme, "https")) {
        CURLUcode rc = curl_url_get(u, CURLUPART_HOST, &host, CURLU_PUNYCODE);
        char norm[PRISM_FETCH_MAX_HOST + 1];
        /* a host that does not convert to punycode (an IDN libcurl cannot read in this locale) comes
         * back as an out-of-memory error from libcurl 7.88: a URL refusal, not the server's state */
        if (rc != CURLUE_OK || !host_norm(host, strlen(host), norm)) {
            why = PRISM_FETCH_URL;
            goto done;
        }
        if (p->n_domains) {
            why = PRISM_FETCH_DOMAIN;
            for (int i = 0; i < p->n_domains; i++)
                if (!strcmp(p->domains[i], norm)) why = PRISM_FETCH_OK;
            if (why != PRISM_FETCH_OK) goto done;
        }
    } else if (!strcmp(scheme, "file")) {
        if (!allow_file) why = PRISM_FETCH_SCHEME;
        else if (p->local_dirfd < 0) why = PRISM_FETCH_FILE_DISABLED;
        if (why != PRISM_FETCH_OK) goto done;
        is_file = true;
    } else {
        why = PRISM_FETCH_SCHEME;
        goto done;
    }
    /* the fragment never leaves the client: two URLs that differ only there are one download */
    if (curl_url_set(u, CURLUPART_FRAGMENT, NULL, 0) != CURLUE_OK) {
        why = PRISM_FETCH_NOMEM;
        goto done;
    }
    char *key = NULL;
    CURLUcode rc = make_key(u, &key);
    if (rc != CURLUE_OK) {
        why = from_uc(rc, PRISM_FETCH_URL);
        goto done;
    }
    /* The key must read back as itself: libcurl 7.88 turns "file:/?@/x" into a URL without a path
     * that it writes as "file://(nil)". A URL whose own spelling does not parse to the same URL is
     * refused rather than cached or opened under a name that means something else. */
    CURLU *chk = curl_url();
    char *key2 = NULL;
    rc = chk ? curl_url_set(chk, CURLUPART_URL, key, 0) : CURLUE_OUT_OF_MEMORY;
    if (rc == CURLUE_OK) rc = make_key(chk, &key2);
    bool same = rc == CURLUE_OK && !strcmp(key, key2);
    curl_free(key2);
    if (chk) curl_url_cleanup(chk);
    if (!same) {
        curl_free(key);
        why = rc == CURLUE_OUT_OF_MEMORY ? PRISM_FETCH_NOMEM : PRISM_FETCH_URL;
        goto done;
    }
    out->u = u;
    out->key = key;
    out->is_file = is_file;
    u = NULL;
done:
    curl_free(scheme);
    curl_free(cred);
    curl_free(host);
    if (u) curl_url_cleanup(u);
    return why;
}

prism_fetch_reason_t prism_fetch_policy_url(const prism_fetch_policy_t *p, const char *url, size_t len,
                                            prism_fetch_url_t *out)
{
    memset(out, 0, sizeof *out);
    if (len == 0 || len > PRISM_FETCH_MAX_URL || memchr(url, 0, len)) return PRISM_FETCH_URL;
    char *buf = prism_strndup(url, len);
    CURLU *u = curl_url();
    if (!buf || !u) {
        prism_free(buf);
        if (u) curl_url_cleanup(u);
        return PRISM_FETCH_NOMEM;
    }
    CURLUcode rc = curl_url_set(u, CURLUPART_URL, buf, 0);
    prism_free(buf);
    if (rc != CURLUE_OK) {
        curl_url_cleanup(u);
        return from_uc(rc, PRISM_FETCH_URL);
    }
    return check_parsed(p, u, true, out);
}

prism_fetch_reason_t prism_fetch_policy_redirect(const prism_fetch_policy_t *p, const prism_fetch_url_t *from,
                                                 const char *location, size_t len, prism_fetch_url_t *out)
{
    memset(out, 0, sizeof *out);
    if (len == 0 || len > PRISM_FETCH_MAX_URL || memchr(location, 0, len)) return PRISM_FETCH_REDIRECTS;
    char *buf = prism_strndup(location, len);
    CURLU *u = curl_url_dup(from->u);
    if (!buf || !u) {
        prism_free(buf);
        if (u) curl_url_cleanup(u);
        return PRISM_FETCH_NOMEM;
    }
    /* a handle holding a URL resolves a relative one against it (RFC 3986) */
    CURLUcode rc = curl_url_set(u, CURLUPART_URL, buf, 0);
    prism_free(buf);
    if (rc != CURLUE_OK) {
        curl_url_cleanup(u);
        return from_uc(rc, PRISM_FETCH_REDIRECTS);
    }
    return check_parsed(p, u, false, out);
}

/* openat2 beneath dirfd without symlinks; -1 with errno (ENOSYS where the kernel lacks it). */
static int open_beneath(int dirfd, const char *rel)
{
#ifdef SYS_openat2
    struct open_how how = {
        .flags = O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK,
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    return (int)syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
#else
    errno = ENOSYS;
    return -1;
#endif
}

/* The same without openat2: one component at a time, never following a link and never going up. */
static prism_fetch_reason_t walk_beneath(int dirfd, const char *rel, int *fd_out)
{
    int cur = fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
    if (cur < 0) return PRISM_FETCH_FILE_NOT_FOUND;
    prism_fetch_reason_t why = PRISM_FETCH_FILE_NOT_FOUND;
    const char *s = rel;
    char comp[NAME_MAX + 1];
    for (;;) {
        while (*s == '/') s++;
        const char *e = strchr(s, '/');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (n == 0) break;               /* a trailing slash: the path names a directory */
        if (n > NAME_MAX) break;
        memcpy(comp, s, n);
        comp[n] = 0;
        s += n;
        const char *t = s;
        while (*t == '/') t++;
        bool last = *t == 0;
        if (last && t != s) break;       /* "name/": a directory, not a file (as openat2 says: ENOTDIR) */
        if (!strcmp(comp, ".")) {
            if (last) break;
            continue;
        }
        if (!strcmp(comp, "..")) {
            why = PRISM_FETCH_FILE_OUTSIDE;
            break;
        }
        int flags = last ? O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK
                         : O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
        int next = openat(cur, comp, flags);
        if (next < 0) {
            struct stat st;
            if ((errno == ELOOP || errno == ENOTDIR) && fstatat(cur, comp, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                S_ISLNK(st.st_mode))
                why = PRISM_FETCH_FILE_SYMLINK;
            break;
        }
        close(cur);
        cur = next;
        if (last) {
            *fd_out = cur;
            return PRISM_FETCH_OK;
        }
    }
    close(cur);
    return why;
}

prism_fetch_reason_t prism_fetch_policy_open_local(const prism_fetch_policy_t *p, const prism_fetch_url_t *u,
                                                   int *fd_out, uint64_t *size)
{
    *fd_out = -1;
    *size = 0;
    if (!u->is_file || p->local_dirfd < 0) return PRISM_FETCH_FILE_DISABLED;
    char *path = NULL;
    CURLUcode rc = curl_url_get(u->u, CURLUPART_PATH, &path, CURLU_URLDECODE);
    if (rc != CURLUE_OK) return from_uc(rc, PRISM_FETCH_URL);  /* %00 in the path, say */
    size_t plen = strlen(path);
    const char *rel = NULL;
    const char *dirs[2] = {p->local_dir, p->local_dir_given};
    for (int i = 0; i < 2 && !rel; i++) {
        size_t dl = strlen(dirs[i]);
        if (dl == 0) continue;
        if (dl == 1 && dirs[i][0] == '/') rel = path;      /* the whole tree (an operator's choice) */
        else if (plen > dl && !memcmp(path, dirs[i], dl) && path[dl] == '/') rel = path + dl;
    }
    prism_fetch_reason_t why = PRISM_FETCH_OK;
    int fd = -1;
    if (!rel) {
        why = PRISM_FETCH_FILE_OUTSIDE;
        goto done;
    }
    while (*rel == '/') rel++;
    if (!*rel) {
        why = PRISM_FETCH_FILE_NOT_REGULAR;
        goto done;
    }
    fd = p->no_openat2 ? (errno = ENOSYS, -1) : open_beneath(p->local_dirfd, rel);
    if (fd < 0) {
        int e = errno;
        if (e == ENOSYS || e == EPERM || e == E2BIG) {
            why = walk_beneath(p->local_dirfd, rel, &fd);   /* no openat2 (old kernel, seccomp) */
        } else {
            why = e == ELOOP ? PRISM_FETCH_FILE_SYMLINK : e == EXDEV ? PRISM_FETCH_FILE_OUTSIDE : PRISM_FETCH_FILE_NOT_FOUND;
        }
        if (why != PRISM_FETCH_OK) goto done;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        why = PRISM_FETCH_FILE_NOT_FOUND;
    } else if (!S_ISREG(st.st_mode)) {
        why = PRISM_FETCH_FILE_NOT_REGULAR;
    } else {
        *fd_out = fd;
        *size = (uint64_t)st.st_size;
        fd = -1;
    }
done:
    if (fd >= 0) close(fd);
    curl_free(path);
    return why;
}
