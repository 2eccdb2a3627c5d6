/* prism_keygen: creates a cluster's CURVE key directory: one keypair per role
 * (router, encoder, prefill, decode) as DIR/<role>.key (secret, 0600) and DIR/<role>.pub.
 * Give every process of the cluster --curve-keys DIR (a host needs the .key of the roles it runs
 * and every .pub; see docs/SECURITY.md). Existing keys are kept unless --force. */
#include "core/cli.h"
#include "net/net.h"

#include <stdio.h>

int main(int argc, char **argv)
{
    const char *out = NULL;
    prism_str_list_t roles = {0};
    bool force = false;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("out", &out, "Key directory to create or complete (required)"),
        PRISM_FLAG_LIST("roles", &roles, "Roles to make keys for (default: router,encoder,prefill,decode)"),
        PRISM_FLAG_BOOL("force", &force, "Replace existing keys (every process must then get the new directory)"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_keygen",
                             "Creates the CURVE keys that authenticate a Prism cluster's internal links.", flags);
    if (rc) return rc > 0 ? 0 : 2;
    if (!out || !*out) {
        fprintf(stderr, "prism_keygen: --out DIR is required (see --help)\n");
        return 2;
    }
    unsigned mask = 0;
    for (int i = 0; i < roles.n; i++) {
        prism_net_role_t r = prism_net_role_parse(roles.items[i]);
        if (r == PRISM_NET_ROLE_NONE) {
            fprintf(stderr, "prism_keygen: unknown role '%s' (router, encoder, prefill, decode)\n", roles.items[i]);
            return 2;
        }
        mask |= PRISM_NET_ALLOW(r);
    }
    if (!mask)
        for (int r = 1; r < PRISM_NET_ROLE_COUNT; r++) mask |= PRISM_NET_ALLOW(r);
    char err[512];
    if (prism_net_keygen(out, mask, force, err, sizeof(err)) != PRISM_OK) {
        fprintf(stderr, "prism_keygen: %s\n", err);
        return 1;
    }
    for (int r = 1; r < PRISM_NET_ROLE_COUNT; r++)
        if (mask & PRISM_NET_ALLOW(r)) printf("%s/%s.key %s/%s.pub\n", out, prism_net_role_name(r), out, prism_net_role_name(r));
    return 0;
}
