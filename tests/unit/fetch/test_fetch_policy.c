/* The SSRF rules of image fetching (router/fetch_policy.h): address classes, CIDR networks, the URL
 * rules through libcurl's parser, redirects resolved and re-checked, and file:// opened beneath the
 * allowed directory without following symbolic links (openat2, and the O_NOFOLLOW walk). */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fetch_policy.h"

static prism_fetch_reason_t cls(const char *ip)
{
    prism_ip_t a;
    assert_int_equal(prism_ip_parse(ip, strlen(ip), &a), PRISM_OK);
    return prism_ip_classify(&a);
}

static void test_address_classes(void **state)
{
    (void)state;
    static const struct {
        const char *ip;
        prism_fetch_reason_t want;
    } t[] = {
        {"8.8.8.8", PRISM_FETCH_OK},
        {"1.1.1.1", PRISM_FETCH_OK},
        {"198.51.100.7", PRISM_FETCH_OK},     /* TEST-NET-2: documentation, not private */
        {"203.0.113.1", PRISM_FETCH_OK},
        {"192.0.2.1", PRISM_FETCH_OK},
        {"100.63.255.255", PRISM_FETCH_OK},
        {"100.128.0.0", PRISM_FETCH_OK},
        {"172.15.255.255", PRISM_FETCH_OK},
        {"172.32.0.0", PRISM_FETCH_OK},
        {"169.253.255.255", PRISM_FETCH_OK},
        {"223.255.255.255", PRISM_FETCH_OK},
        {"127.0.0.1", PRISM_FETCH_ADDR_LOOPBACK},
        {"127.255.255.254", PRISM_FETCH_ADDR_LOOPBACK},
        {"10.0.0.1", PRISM_FETCH_ADDR_PRIVATE},
        {"10.255.255.255", PRISM_FETCH_ADDR_PRIVATE},
        {"172.16.0.1", PRISM_FETCH_ADDR_PRIVATE},
        {"172.31.255.255", PRISM_FETCH_ADDR_PRIVATE},
        {"192.168.1.1", PRISM_FETCH_ADDR_PRIVATE},
        {"169.254.0.1", PRISM_FETCH_ADDR_LINK_LOCAL},
        {"169.254.169.254", PRISM_FETCH_ADDR_METADATA},
        {"100.100.100.200", PRISM_FETCH_ADDR_METADATA},
        {"100.64.0.1", PRISM_FETCH_ADDR_SHARED},
        {"100.127.255.255", PRISM_FETCH_ADDR_SHARED},
        {"224.0.0.1", PRISM_FETCH_ADDR_MULTICAST},
        {"239.255.255.255", PRISM_FETCH_ADDR_MULTICAST},
        {"0.0.0.0", PRISM_FETCH_ADDR_UNSPECIFIED},
        {"0.1.2.3", PRISM_FETCH_ADDR_UNSPECIFIED},
        {"255.255.255.255", PRISM_FETCH_ADDR_RESERVED},
        {"240.0.0.1", PRISM_FETCH_ADDR_RESERVED},
        {"192.0.0.8", PRISM_FETCH_ADDR_RESERVED},
        {"198.18.0.1", PRISM_FETCH_ADDR_RESERVED},
        {"198.19.255.255", PRISM_FETCH_ADDR_RESERVED},
        {"2606:4700::1111", PRISM_FETCH_OK},
        {"2001:db8::1", PRISM_FETCH_OK},
        {"::1", PRISM_FETCH_ADDR_LOOPBACK},
        {"::", PRISM_FETCH_ADDR_UNSPECIFIED},
        {"fe80::1", PRISM_FETCH_ADDR_LINK_LOCAL},
        {"febf::1", PRISM_FETCH_ADDR_LINK_LOCAL},
        {"fec0::1", PRISM_FETCH_ADDR_PRIVATE},
        {"fc00::1", PRISM_FETCH_ADDR_UNIQUE_LOCAL},
        {"fd12:3456::1", PRISM_FETCH_ADDR_UNIQUE_LOCAL},
        {"fd00:ec2::254", PRISM_FETCH_ADDR_METADATA},
        {"ff02::1", PRISM_FETCH_ADDR_MULTICAST},
        /* IPv6 forms that reach an IPv4 host are judged by it */
        {"::ffff:127.0.0.1", PRISM_FETCH_ADDR_LOOPBACK},
        {"::ffff:169.254.169.254", PRISM_FETCH_ADDR_METADATA},
        {"::ffff:8.8.8.8", PRISM_FETCH_OK},
        {"64:ff9b::10.0.0.1", PRISM_FETCH_ADDR_PRIVATE},
        {"64:ff9b::8.8.8.8", PRISM_FETCH_OK},
        {"64:ff9b:1::1", PRISM_FETCH_ADDR_PRIVATE},
        {"2002:7f00:1::", PRISM_FETCH_ADDR_LOOPBACK},    /* 6to4 of 127.0.0.1 */
        {"2002:0808:0808::1", PRISM_FETCH_OK},
        {"2001::1", PRISM_FETCH_ADDR_RESERVED},           /* Teredo */
        {"::127.0.0.1", PRISM_FETCH_ADDR_RESERVED},       /* IPv4-compatible (deprecated) */
        {"100::1", PRISM_FETCH_ADDR_RESERVED},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(t); i++) {
        prism_fetch_reason_t got = cls(t[i].ip);
        if (got != t[i].want)
            fail_msg("%s: %s, expected %s", t[i].ip, prism_fetch_reason_names[got], prism_fetch_reason_names[t[i].want]);
    }
}

static void test_cidr(void **state)
{
    (void)state;
    prism_cidr_t c;
    prism_ip_t ip;
    assert_int_equal(prism_cidr_parse("10.9.0.0/24", 11, &c), PRISM_OK);
    assert_int_equal(c.prefix, 120);
    assert_int_equal(prism_ip_parse("10.9.0.77", 9, &ip), PRISM_OK);
    assert_true(prism_cidr_contains(&c, &ip));
    assert_int_equal(prism_ip_parse("10.9.1.1", 8, &ip), PRISM_OK);
    assert_false(prism_cidr_contains(&c, &ip));
    /* IPv4 networks hold the IPv4-mapped IPv6 form of their addresses */
    assert_int_equal(prism_ip_parse("::ffff:10.9.0.3", 15, &ip), PRISM_OK);
    assert_true(prism_cidr_contains(&c, &ip));
    /* host bits are masked */
    assert_int_equal(prism_cidr_parse("10.9.0.77/24", 12, &c), PRISM_OK);
    assert_int_equal(prism_ip_parse("10.9.0.1", 8, &ip), PRISM_OK);
    assert_true(prism_cidr_contains(&c, &ip));
    /* a bare address is one host */
    assert_int_equal(prism_cidr_parse("127.0.0.1", 9, &c), PRISM_OK);
    assert_int_equal(c.prefix, 128);
    assert_int_equal(prism_ip_parse("127.0.0.2", 9, &ip), PRISM_OK);
    assert_false(prism_cidr_contains(&c, &ip));
    assert_int_equal(prism_cidr_parse("fd00::/8", 8, &c), PRISM_OK);
    assert_int_equal(prism_ip_parse("fd12::1", 7, &ip), PRISM_OK);
    assert_true(prism_cidr_contains(&c, &ip));
    assert_int_equal(prism_cidr_parse("0.0.0.0/0", 9, &c), PRISM_OK);
    assert_int_equal(prism_ip_parse("1.2.3.4", 7, &ip), PRISM_OK);
    assert_true(prism_cidr_contains(&c, &ip));
    assert_int_equal(prism_ip_parse("fd12::1", 7, &ip), PRISM_OK);
    assert_false(prism_cidr_contains(&c, &ip));    /* an IPv4 /0 is not every IPv6 address */
    assert_int_equal(prism_cidr_parse("::1/128", 7, &c), PRISM_OK);
    static const char *bad[] = {"", "/8", "10.0.0.0/", "10.0.0.0/33", "10.0.0.0/-1", "10.0.0.0/+8", "::1/129",
                                "10.0.0/8", "10.0.0.0/8/8", "10.0.0.0/0008", "host/8", "[::1]/128", "10.0.0.0 /8"};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(bad); i++)
        if (prism_cidr_parse(bad[i], strlen(bad[i]), &c) == PRISM_OK) fail_msg("'%s' parsed as a network", bad[i]);
}

static void policy(prism_fetch_policy_t *p, const char *nets, const char *domains, const char *dir)
{
    const char *n[8], *d[8];
    int nn = 0, nd = 0;
    static char nb[512], db[512];
    snprintf(nb, sizeof nb, "%s", nets ? nets : "");
    snprintf(db, sizeof db, "%s", domains ? domains : "");
    for (char *t = strtok(nb, ","); t; t = strtok(NULL, ",")) n[nn++] = t;
    for (char *t = strtok(db, ","); t; t = strtok(NULL, ",")) d[nd++] = t;
    char why[256];
    if (prism_fetch_policy_init(p, n, nn, d, nd, dir, why, sizeof why) != PRISM_OK) fail_msg("policy: %s", why);
}

static void test_allowed_networks(void **state)
{
    (void)state;
    prism_fetch_policy_t p;
    policy(&p, "10.9.0.0/24,127.0.0.1,fd00::/8", NULL, NULL);
    prism_ip_t ip;
    static const struct {
        const char *ip;
        prism_fetch_reason_t want;
    } t[] = {
        {"10.9.0.2", PRISM_FETCH_OK},
        {"10.9.1.2", PRISM_FETCH_ADDR_PRIVATE},
        {"127.0.0.1", PRISM_FETCH_OK},
        {"127.0.0.2", PRISM_FETCH_ADDR_LOOPBACK},
        {"::1", PRISM_FETCH_ADDR_LOOPBACK},
        {"fd00:ec2::254", PRISM_FETCH_OK},           /* allowed networks win over every class */
        {"::ffff:10.9.0.5", PRISM_FETCH_OK},
        {"64:ff9b::10.9.0.5", PRISM_FETCH_OK},       /* by the IPv4 address it carries */
        {"169.254.169.254", PRISM_FETCH_ADDR_METADATA},
        {"8.8.8.8", PRISM_FETCH_OK},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(t); i++) {
        assert_int_equal(prism_ip_parse(t[i].ip, strlen(t[i].ip), &ip), PRISM_OK);
        prism_fetch_reason_t got = prism_fetch_policy_ip(&p, &ip);
        if (got != t[i].want)
            fail_msg("%s: %s, expected %s", t[i].ip, prism_fetch_reason_names[got], prism_fetch_reason_names[t[i].want]);
    }
    /* sockaddrs as libcurl hands them over */
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_port = htons(80)};
    inet_pton(AF_INET, "169.254.169.254", &in.sin_addr);
    assert_int_equal(prism_fetch_policy_addr(&p, (struct sockaddr *)&in, sizeof in), PRISM_FETCH_ADDR_METADATA);
    assert_int_equal(prism_fetch_policy_addr(&p, (struct sockaddr *)&in, sizeof in - 1), PRISM_FETCH_ADDR_RESERVED);
    struct sockaddr_in6 in6 = {.sin6_family = AF_INET6};
    inet_pton(AF_INET6, "::1", &in6.sin6_addr);
    assert_int_equal(prism_fetch_policy_addr(&p, (struct sockaddr *)&in6, sizeof in6), PRISM_FETCH_ADDR_LOOPBACK);
    struct sockaddr un = {.sa_family = AF_UNIX};
    assert_int_equal(prism_fetch_policy_addr(&p, &un, sizeof un), PRISM_FETCH_ADDR_RESERVED);
    prism_fetch_policy_free(&p);
    char why[256];
    const char *badnet[] = {"10.0.0.0/33"};
    assert_int_equal(prism_fetch_policy_init(&p, badnet, 1, NULL, 0, NULL, why, sizeof why), PRISM_EINVAL);
    assert_non_null(strstr(why, "10.0.0.0/33"));
}

static prism_fetch_reason_t url(const prism_fetch_policy_t *p, const char *u, char *key, size_t kn)
{
    prism_fetch_url_t out;
    prism_fetch_reason_t r = prism_fetch_policy_url(p, u, strlen(u), &out);
    if (r == PRISM_FETCH_OK) {
        assert_non_null(out.u);
        assert_non_null(out.key);
        if (key) snprintf(key, kn, "%s", out.key);
    } else {
        assert_null(out.u);
    }
    prism_fetch_url_free(&out);
    return r;
}

static void test_url_rules(void **state)
{
    (void)state;
    prism_fetch_policy_t p;
    policy(&p, NULL, NULL, NULL);
    static const struct {
        const char *url;
        prism_fetch_reason_t want;
    } t[] = {
        {"http://example.com/a.jpg", PRISM_FETCH_OK},
        {"https://example.com:8443/a.jpg?x=1", PRISM_FETCH_OK},
        {"HTTPS://EXAMPLE.com/a.jpg", PRISM_FETCH_OK},
        {"http://198.51.100.2/a.png", PRISM_FETCH_OK},
        {"http://[::1]/a.png", PRISM_FETCH_OK},       /* the address rule refuses it at connect time */
        {"ftp://example.com/a.jpg", PRISM_FETCH_SCHEME},
        {"gopher://example.com/", PRISM_FETCH_SCHEME},
        {"dict://example.com/", PRISM_FETCH_SCHEME},
        {"ldap://example.com/", PRISM_FETCH_SCHEME},
        {"javascript:alert(1)", PRISM_FETCH_SCHEME},
        {"data:image/png;base64,AAAA", PRISM_FETCH_SCHEME},
        {"file:///etc/passwd", PRISM_FETCH_FILE_DISABLED},
        {"http://user:pw@example.com/a.jpg", PRISM_FETCH_URL},
        {"http://user@example.com/a.jpg", PRISM_FETCH_URL},
        {"http://:pw@example.com/a.jpg", PRISM_FETCH_URL},
        {"example.com/a.jpg", PRISM_FETCH_URL},
        {"//example.com/a.jpg", PRISM_FETCH_URL},
        {"http://", PRISM_FETCH_URL},
        {"http:///a.jpg", PRISM_FETCH_OK},      /* libcurl reads host "a.jpg", as browsers do: what it connects to */
        {"http://exa mple.com/", PRISM_FETCH_URL},
        {"http://example.com/a b.jpg", PRISM_FETCH_URL},
        {"http://example.com:99999/", PRISM_FETCH_URL},
        {"", PRISM_FETCH_URL},
        /* libcurl 7.88 parses this into a URL without a path that it writes as "file://(nil)": a URL
         * whose spelling does not read back as itself is refused (found by fuzz_fetch_url) */
        {"http:/?@/sub/x", PRISM_FETCH_URL},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(t); i++) {
        prism_fetch_reason_t got = url(&p, t[i].url, NULL, 0);
        if (got != t[i].want)
            fail_msg("%s: %s, expected %s", t[i].url, prism_fetch_reason_names[got], prism_fetch_reason_names[t[i].want]);
    }
    /* a NUL inside, and too long */
    prism_fetch_url_t out;
    assert_int_equal(prism_fetch_policy_url(&p, "http://a.com/\0x", 15, &out), PRISM_FETCH_URL);
    prism_fetch_policy_t pf;
    policy(&pf, NULL, NULL, "/tmp");
    assert_int_equal(url(&pf, "file:/?@/sub/x", NULL, 0), PRISM_FETCH_URL);
    prism_fetch_policy_free(&pf);
    size_t n = PRISM_FETCH_MAX_URL + 1;
    char *longu = malloc(n + 1);
    memcpy(longu, "http://example.com/", 19);
    memset(longu + 19, 'a', n - 19);
    longu[n] = 0;
    assert_int_equal(prism_fetch_policy_url(&p, longu, n, &out), PRISM_FETCH_URL);
    longu[PRISM_FETCH_MAX_URL] = 0;
    assert_int_equal(prism_fetch_policy_url(&p, longu, PRISM_FETCH_MAX_URL, &out), PRISM_FETCH_OK);
    prism_fetch_url_free(&out);
    free(longu);
    /* the cache key: normalized, without the fragment (never sent) */
    char k1[512], k2[512];
    assert_int_equal(url(&p, "HTTP://Example.COM:80/a/../b.jpg#frag", k1, sizeof k1), PRISM_FETCH_OK);
    assert_int_equal(url(&p, "http://example.com/b.jpg", k2, sizeof k2), PRISM_FETCH_OK);
    assert_string_equal(k1, k2);
    assert_null(strchr(k1, '#'));
    prism_fetch_policy_free(&p);
}

static void test_domains(void **state)
{
    (void)state;
    prism_fetch_policy_t p;
    policy(&p, NULL, "images.example.com,CDN.Example.org.,[::1],bücher.example", NULL);
    static const struct {
        const char *url;
        prism_fetch_reason_t want;
    } t[] = {
        {"https://images.example.com/a.jpg", PRISM_FETCH_OK},
        {"https://IMAGES.example.com./a.jpg", PRISM_FETCH_OK},
        {"https://cdn.example.org/a.jpg", PRISM_FETCH_OK},
        {"http://[::1]:8080/a.jpg", PRISM_FETCH_OK},
        {"https://example.com/a.jpg", PRISM_FETCH_DOMAIN},
        {"https://evil.images.example.com/a.jpg", PRISM_FETCH_DOMAIN},   /* exact names, as vLLM */
        {"https://images.example.com.evil.net/a.jpg", PRISM_FETCH_DOMAIN},
        {"https://images.example.com@evil.net/a.jpg", PRISM_FETCH_URL},
        {"https://evil.net/images.example.com/a.jpg", PRISM_FETCH_DOMAIN},
        {"https://evil.net#@images.example.com/a.jpg", PRISM_FETCH_DOMAIN},
        {"https://127.0.0.1/a.jpg", PRISM_FETCH_DOMAIN},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(t); i++) {
        prism_fetch_reason_t got = url(&p, t[i].url, NULL, 0);
        if (got != t[i].want)
            fail_msg("%s: %s, expected %s", t[i].url, prism_fetch_reason_names[got], prism_fetch_reason_names[t[i].want]);
    }
    /* an IDN allowlist entry as given (UTF-8) does not match its punycode: the operator lists punycode */
    assert_int_equal(url(&p, "https://xn--bcher-kva.example/a.jpg", NULL, 0), PRISM_FETCH_DOMAIN);
    prism_fetch_policy_free(&p);
    policy(&p, NULL, "xn--bcher-kva.example", NULL);
    assert_int_equal(url(&p, "https://xn--bcher-kva.example/a.jpg", NULL, 0), PRISM_FETCH_OK);
    prism_fetch_reason_t idn = url(&p, "https://bücher.example/a.jpg", NULL, 0);
    assert_true(idn == PRISM_FETCH_OK || idn == PRISM_FETCH_URL);   /* libcurl without libidn2: refused */
    prism_fetch_policy_free(&p);
}

static void test_redirects(void **state)
{
    (void)state;
    prism_fetch_policy_t p;
    policy(&p, NULL, "a.example,b.example", "/tmp");
    prism_fetch_url_t from, to;
    assert_int_equal(prism_fetch_policy_url(&p, "https://a.example/dir/x.jpg?q=1", 31, &from), PRISM_FETCH_OK);
    static const struct {
        const char *loc;
        prism_fetch_reason_t want;
        const char *key;
    } t[] = {
        {"y.jpg", PRISM_FETCH_OK, "https://a.example/dir/y.jpg"},
        {"/z.png", PRISM_FETCH_OK, "https://a.example/z.png"},
        {"../up.png", PRISM_FETCH_OK, "https://a.example/up.png"},
        {"//b.example/c.jpg", PRISM_FETCH_OK, "https://b.example/c.jpg"},
        {"http://b.example/c.jpg#f", PRISM_FETCH_OK, "http://b.example/c.jpg"},
        {"https://c.example/c.jpg", PRISM_FETCH_DOMAIN, NULL},
        {"file:///tmp/x.jpg", PRISM_FETCH_SCHEME, NULL},     /* never to file://, even when file:// is on */
        {"ftp://a.example/x", PRISM_FETCH_SCHEME, NULL},
        {"https://u:p@a.example/x", PRISM_FETCH_URL, NULL},
        {"http://a.example:99999/", PRISM_FETCH_REDIRECTS, NULL},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(t); i++) {
        prism_fetch_reason_t got = prism_fetch_policy_redirect(&p, &from, t[i].loc, strlen(t[i].loc), &to);
        if (got != t[i].want)
            fail_msg("%s: %s, expected %s", t[i].loc, prism_fetch_reason_names[got], prism_fetch_reason_names[t[i].want]);
        if (t[i].key) assert_string_equal(to.key, t[i].key);
        prism_fetch_url_free(&to);
    }
    assert_int_equal(prism_fetch_policy_redirect(&p, &from, "", 0, &to), PRISM_FETCH_REDIRECTS);
    prism_fetch_url_free(&from);
    prism_fetch_policy_free(&p);
}

/* ---- file:// ---- */

static char root[PATH_MAX];   /* tmp/ with media/ (allowed) and secret/ beside it */

static void writef(const char *rel, const char *text)
{
    char path[PATH_MAX * 2];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void mk(const char *rel)
{
    char path[PATH_MAX * 2];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    assert_int_equal(mkdir(path, 0755), 0);
}

static void ln(const char *target, const char *rel)
{
    char path[PATH_MAX * 2];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    assert_int_equal(symlink(target, path), 0);
}

static int setup_files(void **state)
{
    (void)state;
    snprintf(root, sizeof root, "%s/prism-fetch-policy-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(root)) return -1;
    char real[PATH_MAX];
    if (!realpath(root, real)) return -1;
    snprintf(root, sizeof root, "%s", real);
    mk("media");
    mk("media/sub");
    mk("secret");
    writef("media/a.jpg", "AAAA");
    writef("media/sub/b.jpg", "BB");
    writef("secret/s.txt", "secret");
    ln("../secret/s.txt", "media/up.jpg");            /* a link out of the directory */
    ln("a.jpg", "media/in.jpg");                      /* a link that stays inside: refused as well */
    ln("../secret", "media/secretdir");               /* a directory link out */
    ln("sub", "media/subln");                         /* a directory link inside */
    char fifo[PATH_MAX * 2];
    snprintf(fifo, sizeof fifo, "%s/media/fifo", root);
    assert_int_equal(mkfifo(fifo, 0644), 0);
    return 0;
}

static int teardown_files(void **state)
{
    (void)state;
    char cmd[PATH_MAX + 32];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    return system(cmd) == 0 ? 0 : -1;
}

static prism_fetch_reason_t open_url(const prism_fetch_policy_t *p, const char *u, char *got, size_t gn)
{
    prism_fetch_url_t pu;
    prism_fetch_reason_t r = prism_fetch_policy_url(p, u, strlen(u), &pu);
    if (r != PRISM_FETCH_OK) return r;
    int fd = -1;
    uint64_t size = 0;
    r = prism_fetch_policy_open_local(p, &pu, &fd, &size);
    prism_fetch_url_free(&pu);
    if (r == PRISM_FETCH_OK) {
        assert_true(fd >= 0);
        ssize_t n = read(fd, got, gn - 1);
        assert_int_equal(n, (ssize_t)size);
        got[n] = 0;
        close(fd);
    } else {
        assert_int_equal(fd, -1);
    }
    return r;
}

static void check_files(bool walk)
{
    char dir[PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s/media/", root);   /* a trailing slash as an operator may write it */
    prism_fetch_policy_t p;
    policy(&p, NULL, NULL, dir);
    p.no_openat2 = walk;
    char got[64], u[PATH_MAX * 2];
    static const struct {
        const char *rel;
        prism_fetch_reason_t want;
        const char *text;
    } t[] = {
        {"media/a.jpg", PRISM_FETCH_OK, "AAAA"},
        {"media/sub/b.jpg", PRISM_FETCH_OK, "BB"},
        {"media/./sub//b.jpg", PRISM_FETCH_OK, "BB"},
        {"media/%61.jpg", PRISM_FETCH_OK, "AAAA"},                      /* percent-decoded */
        {"media/up.jpg", PRISM_FETCH_FILE_SYMLINK, NULL},
        {"media/in.jpg", PRISM_FETCH_FILE_SYMLINK, NULL},
        {"media/secretdir/s.txt", PRISM_FETCH_FILE_SYMLINK, NULL},
        {"media/subln/b.jpg", PRISM_FETCH_FILE_SYMLINK, NULL},
        {"media/sub/%2e%2e/%2e%2e/secret/s.txt", PRISM_FETCH_FILE_OUTSIDE, NULL},
        {"media/../secret/s.txt", PRISM_FETCH_FILE_OUTSIDE, NULL},      /* curl folds the dots: outside by prefix */
        {"secret/s.txt", PRISM_FETCH_FILE_OUTSIDE, NULL},
        {"media", PRISM_FETCH_FILE_OUTSIDE, NULL},
        {"mediax/a.jpg", PRISM_FETCH_FILE_OUTSIDE, NULL},
        {"media/", PRISM_FETCH_FILE_NOT_REGULAR, NULL},
        {"media/sub", PRISM_FETCH_FILE_NOT_REGULAR, NULL},
        {"media/fifo", PRISM_FETCH_FILE_NOT_REGULAR, NULL},
        {"media/none.jpg", PRISM_FETCH_FILE_NOT_FOUND, NULL},
        {"media/a.jpg/x", PRISM_FETCH_FILE_NOT_FOUND, NULL},
        {"media/a.jpg/", PRISM_FETCH_FILE_NOT_FOUND, NULL},   /* a file named as a directory (fuzz_fetch_url) */
        {"media/a%00.jpg", PRISM_FETCH_URL, NULL},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(t); i++) {
        snprintf(u, sizeof u, "file://%s/%s", root, t[i].rel);
        prism_fetch_reason_t r = open_url(&p, u, got, sizeof got);
        if (r != t[i].want)
            fail_msg("%s (%s): %s, expected %s", t[i].rel, walk ? "walk" : "openat2", prism_fetch_reason_names[r],
                     prism_fetch_reason_names[t[i].want]);
        if (t[i].text) assert_string_equal(got, t[i].text);
    }
    snprintf(u, sizeof u, "file://localhost%s/media/a.jpg", root);
    assert_int_equal(open_url(&p, u, got, sizeof got), PRISM_FETCH_OK);
    snprintf(u, sizeof u, "file://otherhost%s/media/a.jpg", root);
    assert_int_equal(open_url(&p, u, got, sizeof got), PRISM_FETCH_URL);
    prism_fetch_policy_free(&p);
}

static void test_files_openat2(void **state)
{
    (void)state;
    check_files(false);
}

static void test_files_walk(void **state)
{
    (void)state;
    check_files(true);
}

static void test_file_dir_given_through_a_link(void **state)
{
    (void)state;
    /* the operator names the directory through a symlink: URLs may use either spelling, and the link
     * in the directory's own path is the operator's, not followed per request */
    char link[PATH_MAX + 16], u[PATH_MAX * 2], got[64];
    snprintf(link, sizeof link, "%s/medialink", root);
    ln("media", "medialink");
    prism_fetch_policy_t p;
    policy(&p, NULL, NULL, link);
    snprintf(u, sizeof u, "file://%s/a.jpg", link);
    assert_int_equal(open_url(&p, u, got, sizeof got), PRISM_FETCH_OK);
    snprintf(u, sizeof u, "file://%s/media/a.jpg", root);
    assert_int_equal(open_url(&p, u, got, sizeof got), PRISM_FETCH_OK);
    prism_fetch_policy_free(&p);
    char why[256];
    assert_int_equal(prism_fetch_policy_init(&p, NULL, 0, NULL, 0, "relative/dir", why, sizeof why), PRISM_EINVAL);
    assert_int_equal(prism_fetch_policy_init(&p, NULL, 0, NULL, 0, "/nonexistent-prism-dir", why, sizeof why),
                     PRISM_EINVAL);
    unlink(link);
}

static void test_reason_tables(void **state)
{
    (void)state;
    for (int i = 0; i < PRISM_FETCH_REASON_COUNT; i++) {
        assert_non_null(prism_fetch_reason_names[i]);
        assert_non_null(prism_fetch_reason_message(i));
        int st = prism_fetch_reason_http_status(i);
        assert_true(st == 200 || st == 400 || st == 503);
    }
    assert_int_equal(prism_fetch_reason_http_status(PRISM_FETCH_BUSY), 503);
    assert_int_equal(prism_fetch_reason_http_status(PRISM_FETCH_ADDR_PRIVATE), 400);
    assert_true(prism_fetch_reason_is_address(PRISM_FETCH_ADDR_METADATA));
    assert_false(prism_fetch_reason_is_address(PRISM_FETCH_DOMAIN));
}

int main(void)
{
    prism_log_init("test_fetch_policy", PRISM_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_address_classes),
        cmocka_unit_test(test_cidr),
        cmocka_unit_test(test_allowed_networks),
        cmocka_unit_test(test_url_rules),
        cmocka_unit_test(test_domains),
        cmocka_unit_test(test_redirects),
        cmocka_unit_test_setup_teardown(test_files_openat2, setup_files, teardown_files),
        cmocka_unit_test_setup_teardown(test_files_walk, setup_files, teardown_files),
        cmocka_unit_test_setup_teardown(test_file_dir_given_through_a_link, setup_files, teardown_files),
        cmocka_unit_test(test_reason_tables),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
