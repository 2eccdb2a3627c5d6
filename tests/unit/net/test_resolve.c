/* Unit tests: router endpoints named by DNS (net/resolve.h) — which endpoints are names, expansion
 * to one endpoint per address, and the resolver thread following a name as its addresses come and
 * go, keeping them through failed lookups. A scripted lookup stands in for DNS; "localhost" checks
 * the real getaddrinfo path. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <string.h>
#include <stdio.h>
#include <unistd.h>

#include "net/resolve.h"

/* What the scripted DNS answers now; a test changes it between rounds. */
typedef struct {
    int rc;                 /* PRISM_OK, PRISM_ENOTFOUND, PRISM_EAGAIN */
    const char *addrs[8];
    int n;
    int calls;
} fake_dns_t;

static int fake_lookup(const char *host, char (*addrs)[16], int max, int *n, void *ud)
{
    fake_dns_t *d = ud;
    d->calls++;
    *n = 0;
    if (strcmp(host, "routers.prism") != 0) return PRISM_ENOTFOUND;
    if (d->rc != PRISM_OK) return d->rc;
    for (int i = 0; i < d->n && i < max; i++) snprintf(addrs[(*n)++], 16, "%s", d->addrs[i]);
    return PRISM_OK;
}

static prism_str_list_t list(int n, ...)
{
    prism_str_list_t l = {0};
    va_list ap;
    va_start(ap, n);
    for (int i = 0; i < n; i++) l.items[l.n++] = va_arg(ap, const char *);
    va_end(ap);
    return l;
}

static void test_is_name(void **state)
{
    (void)state;
    assert_true(prism_endpoint_is_name("tcp://routers.prism:8100"));
    assert_true(prism_endpoint_is_name("tcp://localhost:8100"));
    assert_false(prism_endpoint_is_name("tcp://10.1.2.3:8100"));
    assert_false(prism_endpoint_is_name("tcp://*:8100"));
    assert_false(prism_endpoint_is_name("tcp://[::1]:8100"));
    assert_false(prism_endpoint_is_name("tcp://eth0;10.0.0.1:8100"));
    assert_false(prism_endpoint_is_name("ipc:///tmp/router"));
    assert_false(prism_endpoint_is_name("inproc://x"));
    assert_false(prism_endpoint_is_name("tcp://routers.prism"));   /* no port: not ours to guess */
}

static void test_expand(void **state)
{
    (void)state;
    fake_dns_t d = {.rc = PRISM_OK, .addrs = {"10.0.0.9", "10.0.0.2", "10.0.0.9"}, .n = 3};
    prism_str_list_t in = list(3, "tcp://10.0.0.2:8100", "tcp://routers.prism:8100", "ipc:///run/r");
    prism_endpoints_t out;
    char err[200];
    assert_int_equal(prism_endpoints_expand(&in, fake_lookup, &d, &out, err, sizeof(err)), PRISM_OK);
    /* in the given order, a name's addresses sorted; duplicates (with the literal too) once */
    assert_int_equal(out.n, 3);
    assert_string_equal(out.ep[0], "tcp://10.0.0.2:8100");
    assert_string_equal(out.ep[1], "tcp://10.0.0.9:8100");
    assert_string_equal(out.ep[2], "ipc:///run/r");
    /* a name that fails to resolve contributes nothing; a malformed tcp endpoint is an error */
    d.rc = PRISM_EAGAIN;
    in = list(1, "tcp://routers.prism:8100");
    assert_int_equal(prism_endpoints_expand(&in, fake_lookup, &d, &out, err, sizeof(err)), PRISM_OK);
    assert_int_equal(out.n, 0);
    in = list(1, "tcp://routers.prism");
    assert_int_equal(prism_endpoints_expand(&in, fake_lookup, &d, &out, err, sizeof(err)), PRISM_EINVAL);
    assert_non_null(strstr(err, "tcp://HOST:PORT"));
    /* the real resolver: localhost is 127.0.0.1 */
    in = list(1, "tcp://localhost:8100");
    assert_int_equal(prism_endpoints_expand(&in, NULL, NULL, &out, err, sizeof(err)), PRISM_OK);
    assert_int_equal(out.n, 1);
    assert_string_equal(out.ep[0], "tcp://127.0.0.1:8100");
}

static void wait_rounds(prism_resolver_t *r, uint64_t n)
{
    for (int i = 0; i < 2000 && prism_resolver_rounds(r) < n; i++) usleep(1000);
    assert_true(prism_resolver_rounds(r) >= n);
}

static void test_resolver_follows_the_name(void **state)
{
    (void)state;
    fake_dns_t d = {.rc = PRISM_OK, .addrs = {"10.0.0.1", "10.0.0.2"}, .n = 2};
    prism_str_list_t in = list(1, "tcp://routers.prism:8100");
    prism_resolver_t *r;
    prism_endpoints_t e;
    assert_int_equal(prism_resolver_start(&in, 0.05, fake_lookup, &d, &r), PRISM_OK);
    wait_rounds(r, 1);
    assert_true(prism_resolver_take(r, &e));
    assert_int_equal(e.n, 2);
    assert_string_equal(e.ep[0], "tcp://10.0.0.1:8100");
    assert_string_equal(e.ep[1], "tcp://10.0.0.2:8100");
    uint64_t k = prism_resolver_rounds(r);
    wait_rounds(r, k + 2);
    assert_false(prism_resolver_take(r, &e));       /* nothing changed: nothing to take */

    /* a router joins */
    d.addrs[2] = "10.0.0.3";
    d.n = 3;
    wait_rounds(r, prism_resolver_rounds(r) + 2);
    assert_true(prism_resolver_take(r, &e));
    assert_int_equal(e.n, 3);
    assert_string_equal(e.ep[2], "tcp://10.0.0.3:8100");

    /* DNS fails for a while: the last addresses stay */
    d.rc = PRISM_EAGAIN;
    wait_rounds(r, prism_resolver_rounds(r) + 3);
    assert_false(prism_resolver_take(r, &e));

    /* it answers again without the first router: that one leaves */
    d.rc = PRISM_OK;
    d.addrs[0] = "10.0.0.3";
    d.n = 2;                                          /* 10.0.0.3, 10.0.0.2 */
    wait_rounds(r, prism_resolver_rounds(r) + 2);
    assert_true(prism_resolver_take(r, &e));
    assert_int_equal(e.n, 2);
    assert_string_equal(e.ep[0], "tcp://10.0.0.2:8100");
    assert_string_equal(e.ep[1], "tcp://10.0.0.3:8100");

    /* the name is gone (NXDOMAIN: no router pod at all): no endpoint */
    d.rc = PRISM_ENOTFOUND;
    wait_rounds(r, prism_resolver_rounds(r) + 2);
    assert_true(prism_resolver_take(r, &e));
    assert_int_equal(e.n, 0);
    prism_resolver_stop(r);
    assert_true(d.calls >= 10);
}

static void test_resolver_stops_promptly(void **state)
{
    (void)state;
    fake_dns_t d = {.rc = PRISM_OK, .addrs = {"10.0.0.1"}, .n = 1};
    prism_str_list_t in = list(1, "tcp://routers.prism:8100");
    prism_resolver_t *r;
    assert_int_equal(prism_resolver_start(&in, 3600, fake_lookup, &d, &r), PRISM_OK);
    wait_rounds(r, 1);
    double t0 = prism_now_s();
    prism_resolver_stop(r);                           /* wakes the hour-long wait */
    assert_true(prism_now_s() - t0 < 1.0);
    prism_resolver_stop(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_is_name),
        cmocka_unit_test(test_expand),
        cmocka_unit_test(test_resolver_follows_the_name),
        cmocka_unit_test(test_resolver_stops_promptly),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
