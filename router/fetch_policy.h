/* fetch_policy: which image URLs the router may fetch, and which addresses it may connect to (the
 * SSRF rules of router/fetch.h). No I/O but opening a local file; no state beyond the policy, which
 * is built once at start-up and then only read (any thread).
 *
 * URLs are parsed by libcurl's own URL parser (curl_url), the parser the transfer then connects
 * with: a second parser of our own could read a host differently from the one curl connects to (the
 * classic SSRF bypass through parser differences).
 *
 * Rules, in the order a URL meets them:
 *   1. the URL: at most PRISM_FETCH_MAX_URL bytes, no NUL, parsed by curl_url, no user name or
 *      password in it;                                                        else PRISM_FETCH_URL
 *   2. the scheme: http or https; file only with an allowed local directory;  else PRISM_FETCH_SCHEME
 *      (file without one: PRISM_FETCH_FILE_DISABLED)
 *   3. http(s): the host, when an allowlist of domains is given, is one of them (exact match, case
 *      and one trailing dot ignored, IDNs compared in punycode);               else PRISM_FETCH_DOMAIN
 *   4. every address a connection is opened to (after DNS, for every redirect hop and every address
 *      tried): public, or inside an allowed network;  else the address class (PRISM_FETCH_ADDR_*)
 *   5. file: the path lies under the allowed directory and is opened beneath it without following any
 *      symbolic link (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, or a component-by-component
 *      O_NOFOLLOW walk where openat2 is missing); it is a regular file.
 *                                     else PRISM_FETCH_FILE_OUTSIDE / _SYMLINK / _NOT_FOUND / _NOT_REGULAR
 *
 * Address classes (prism_addr_classify), IPv4 and IPv6; an IPv6 address that carries an IPv4 address
 * (IPv4-mapped ::ffff:0:0/96, NAT64 64:ff9b::/96, 6to4 2002::/16) is judged by that IPv4 address too:
 *   loopback 127/8 ::1; private 10/8 172.16/12 192.168/16 fec0::/10 64:ff9b:1::/48; link-local
 *   169.254/16 fe80::/10; shared (CGNAT) 100.64/10; unique-local fc00::/7; multicast 224/4 ff00::/8;
 *   unspecified 0/8 ::; metadata 169.254.169.254 100.100.100.200 fd00:ec2::254 (cloud instance
 *   metadata services); reserved 192.0.0/24 198.18/15 240/4 (broadcast included) 100::/64 Teredo
 *   2001::/32 and the rest of ::/8. Everything else is public, the documentation ranges (192.0.2/24,
 *   198.51.100/24, 203.0.113/24, 2001:db8::/32) included: they are not routed on the internet.
 */
#ifndef PRISM_ROUTER_FETCH_POLICY_H
#define PRISM_ROUTER_FETCH_POLICY_H

#include "core/core.h"

#include <curl/curl.h>
#include <sys/socket.h>

#define PRISM_FETCH_MAX_URL      8192  /* bytes of an image URL */
#define PRISM_FETCH_MAX_NETS     64    /* --allowed-media-networks entries */
#define PRISM_FETCH_MAX_DOMAINS  64    /* --allowed-media-domains entries */
#define PRISM_FETCH_MAX_HOST     253   /* bytes of a domain name */

/* Why a fetch did not give an image; PRISM_FETCH_OK when it did. The names (prism_fetch_reason_names)
 * are the `reason` label of prism:image_fetch_refused_total. */
typedef enum {
    PRISM_FETCH_OK = 0,
    /* the URL itself (checked before anything is sent) */
    PRISM_FETCH_URL,              /* malformed, too long, holds a NUL or credentials */
    PRISM_FETCH_SCHEME,           /* not http or https (file only with an allowed directory) */
    PRISM_FETCH_DOMAIN,           /* host not in --allowed-media-domains */
    /* the address a connection would go to */
    PRISM_FETCH_ADDR_LOOPBACK,
    PRISM_FETCH_ADDR_PRIVATE,
    PRISM_FETCH_ADDR_LINK_LOCAL,
    PRISM_FETCH_ADDR_SHARED,      /* carrier-grade NAT, 100.64.0.0/10 */
    PRISM_FETCH_ADDR_UNIQUE_LOCAL,
    PRISM_FETCH_ADDR_MULTICAST,
    PRISM_FETCH_ADDR_UNSPECIFIED,
    PRISM_FETCH_ADDR_METADATA,    /* a cloud instance-metadata address */
    PRISM_FETCH_ADDR_RESERVED,
    /* file:// */
    PRISM_FETCH_FILE_DISABLED,    /* no --allowed-local-media-path */
    PRISM_FETCH_FILE_OUTSIDE,     /* not under the allowed directory */
    PRISM_FETCH_FILE_SYMLINK,     /* a symbolic link on the way */
    PRISM_FETCH_FILE_NOT_FOUND,   /* missing or not readable */
    PRISM_FETCH_FILE_NOT_REGULAR, /* a directory, FIFO, device... */
    /* the transfer */
    PRISM_FETCH_DNS,              /* the host name did not resolve */
    PRISM_FETCH_CONNECT,          /* no connection */
    PRISM_FETCH_CONNECT_TIMEOUT,
    PRISM_FETCH_TLS,              /* handshake or certificate verification failed */
    PRISM_FETCH_TIMEOUT,          /* the whole fetch (queueing and redirects included) took too long */
    PRISM_FETCH_TOO_SLOW,         /* below the minimum transfer rate */
    PRISM_FETCH_TOO_LARGE_DECLARED, /* Content-Length (or file size) beyond the limit: refused before the body */
    PRISM_FETCH_TOO_LARGE,        /* the body ran past the limit: cut off */
    PRISM_FETCH_REDIRECTS,        /* more redirects than allowed, or one without a usable Location */
    PRISM_FETCH_HTTP_STATUS,      /* an answer other than 200 / 203 (prism_fetch_result_t.http_status) */
    PRISM_FETCH_TRUNCATED,        /* the body ended before its Content-Length */
    PRISM_FETCH_NETWORK,          /* any other transfer failure */
    PRISM_FETCH_BUSY,             /* too many fetches waiting for a slot */
    PRISM_FETCH_NOMEM,
    PRISM_FETCH_REASON_COUNT
} prism_fetch_reason_t;

extern const char *const prism_fetch_reason_names[PRISM_FETCH_REASON_COUNT];
/* One sentence naming the rule (never the fetched content): "image URL refused: ...". */
const char *prism_fetch_reason_message(prism_fetch_reason_t r);
/* The HTTP status a client gets for it: 503 for BUSY and NOMEM (the server's state), 400 otherwise
 * (a URL the client chose that gives no image). */
int prism_fetch_reason_http_status(prism_fetch_reason_t r);
/* True for the address-class reasons. */
bool prism_fetch_reason_is_address(prism_fetch_reason_t r);

/* ---- addresses ---- */

/* An address as 16 bytes: IPv4 a.b.c.d is stored as ::ffff:a.b.c.d (so an IPv4 network matches the
 * IPv4-mapped IPv6 form of its addresses too). */
typedef struct {
    uint8_t b[16];
} prism_ip_t;

typedef struct {
    prism_ip_t net;   /* masked to its prefix */
    int prefix;       /* 0..128, counted over the 16-byte form (IPv4 /n is 96 + n) */
} prism_cidr_t;

/* "a.b.c.d/n", "a.b.c.d" (/32), "v6/n", "v6" (/128); host bits are masked off. PRISM_EINVAL else. */
int  prism_cidr_parse(const char *s, size_t len, prism_cidr_t *out);
bool prism_cidr_contains(const prism_cidr_t *c, const prism_ip_t *ip);
/* From a sockaddr (AF_INET / AF_INET6, len checked); PRISM_EINVAL for anything else. */
int  prism_ip_from_sockaddr(const struct sockaddr *sa, size_t len, prism_ip_t *out);
/* From text (inet_pton of either family, no brackets); PRISM_EINVAL else. */
int  prism_ip_parse(const char *s, size_t len, prism_ip_t *out);
/* PRISM_FETCH_OK for a public address, else its class (a PRISM_FETCH_ADDR_* reason). */
prism_fetch_reason_t prism_ip_classify(const prism_ip_t *ip);
void prism_ip_format(const prism_ip_t *ip, char *out, size_t n);

/* ---- the policy ---- */

typedef struct {
    prism_cidr_t nets[PRISM_FETCH_MAX_NETS];    /* allowed although not public */
    int n_nets;
    char domains[PRISM_FETCH_MAX_DOMAINS][PRISM_FETCH_MAX_HOST + 1];  /* lower case, no trailing dot */
    int n_domains;                              /* 0: any host */
    int local_dirfd;                            /* the allowed local directory (O_PATH), -1: file:// off */
    char local_dir[4096];                       /* its real path, no trailing slash ("/" for the root) */
    char local_dir_given[4096];                 /* as given (trailing slashes dropped): URLs may name either */
    bool no_openat2;                            /* tests: take the O_NOFOLLOW walk even where openat2 exists */
} prism_fetch_policy_t;

/* Builds a policy; nets, domains: entries as given on the command line; local_dir may be NULL.
 * PRISM_EINVAL with why[] naming the bad entry (a network that does not parse, a directory that cannot
 * be opened). Free with prism_fetch_policy_free (closes the directory). */
int  prism_fetch_policy_init(prism_fetch_policy_t *p, const char *const *nets, int n_nets,
                             const char *const *domains, int n_domains, const char *local_dir,
                             char *why, size_t why_n);
void prism_fetch_policy_free(prism_fetch_policy_t *p);

/* Rule 4: PRISM_FETCH_OK when a connection to sa may be opened. */
prism_fetch_reason_t prism_fetch_policy_addr(const prism_fetch_policy_t *p, const struct sockaddr *sa, size_t len);
prism_fetch_reason_t prism_fetch_policy_ip(const prism_fetch_policy_t *p, const prism_ip_t *ip);

/* A URL that passed rules 1-3. */
typedef struct {
    CURLU *u;          /* curl's parse of it (owned); for file URLs too */
    char *key;         /* the normalized URL without its fragment (curl_free): the cache key */
    bool is_file;
} prism_fetch_url_t;

/* Rules 1-3 for url[0..len). On PRISM_FETCH_OK fills *out (free with prism_fetch_url_free). */
prism_fetch_reason_t prism_fetch_policy_url(const prism_fetch_policy_t *p, const char *url, size_t len,
                                            prism_fetch_url_t *out);
/* A redirect's Location resolved against the URL it came from, then rules 1-3 for the result, except
 * that a redirect never leads to file://. On OK *out is the new URL (free with prism_fetch_url_free). */
prism_fetch_reason_t prism_fetch_policy_redirect(const prism_fetch_policy_t *p, const prism_fetch_url_t *from,
                                                 const char *location, size_t len, prism_fetch_url_t *out);
void prism_fetch_url_free(prism_fetch_url_t *u);

/* Rule 5 for a file URL that passed rules 1-3: opens it read-only beneath the allowed directory.
 * On OK *fd is the open file and *size its size. */
prism_fetch_reason_t prism_fetch_policy_open_local(const prism_fetch_policy_t *p, const prism_fetch_url_t *u,
                                                   int *fd, uint64_t *size);

#endif
