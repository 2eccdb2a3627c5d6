#include "core/cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void print_default(const prism_flag_t *f)
{
    switch (f->type) {
    case PRISM_FLAG_TYPE_STR: {
        const char *s = *(const char **)f->target;
        if (s && *s) printf(" (default: %s)", s);
        break;
    }
    case PRISM_FLAG_TYPE_INT:
        printf(" (default: %lld)", (long long)*(int64_t *)f->target);
        break;
    case PRISM_FLAG_TYPE_BYTES: {
        char b[32];
        int64_t v = *(int64_t *)f->target;
        if (v > 0) printf(" (default: %s)", prism_fmt_bytes((size_t)v, b, sizeof(b)));
        else printf(" (default: auto)");
        break;
    }
    case PRISM_FLAG_TYPE_DOUBLE:
        printf(" (default: %g)", *(double *)f->target);
        break;
    default:
        break;
    }
}

static void usage(const char *prog, const char *summary, const prism_flag_t *flags)
{
    printf("Usage: %s [flags]\n\n%s\n\nFlags:\n", prog, summary);
    for (const prism_flag_t *f = flags; f->name; f++) {
        const char *arg = "";
        switch (f->type) {
        case PRISM_FLAG_TYPE_STR: arg = " STR"; break;
        case PRISM_FLAG_TYPE_INT: arg = " N"; break;
        case PRISM_FLAG_TYPE_DOUBLE: arg = " X"; break;
        case PRISM_FLAG_TYPE_BYTES: arg = " BYTES"; break;
        case PRISM_FLAG_TYPE_STR_LIST: arg = " STR[,STR]"; break;
        case PRISM_FLAG_TYPE_BOOL: arg = ""; break;
        }
        printf("  --%s%s\n      %s", f->name, arg, f->help);
        print_default(f);
        printf("\n");
    }
    printf("  --help\n      Show this help and exit\n");
}

static int set_value(const prism_flag_t *f, const char *v)
{
    char *end = NULL;
    errno = 0;
    switch (f->type) {
    case PRISM_FLAG_TYPE_STR:
        *(const char **)f->target = v;
        return 0;
    case PRISM_FLAG_TYPE_INT: {
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end) return -1;
        *(int64_t *)f->target = x;
        return 0;
    }
    case PRISM_FLAG_TYPE_DOUBLE: {
        double x = strtod(v, &end);
        if (errno || end == v || *end) return -1;
        *(double *)f->target = x;
        return 0;
    }
    case PRISM_FLAG_TYPE_BYTES: {
        int64_t x = prism_parse_bytes(v);
        if (x < 0) return -1;
        *(int64_t *)f->target = x;
        return 0;
    }
    case PRISM_FLAG_TYPE_BOOL:
        if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "yes")) *(bool *)f->target = true;
        else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "no")) *(bool *)f->target = false;
        else return -1;
        return 0;
    case PRISM_FLAG_TYPE_STR_LIST: {
        prism_str_list_t *l = f->target;
        /* Comma-separated values are split in place (argv strings are writable). */
        char *s = (char *)v;
        while (s && *s) {
            char *comma = strchr(s, ',');
            if (comma) *comma = 0;
            if (*s) {
                if (l->n >= PRISM_CLI_MAX_LIST) return -1;
                l->items[l->n++] = s;
            }
            s = comma ? comma + 1 : NULL;
        }
        return 0;
    }
    }
    return -1;
}

int prism_cli_parse(int argc, char **argv, const char *prog, const char *summary, prism_flag_t *flags)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(prog, summary, flags);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, a);
            return -1;
        }
        a += 2;
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        const prism_flag_t *f = flags;
        for (; f->name; f++)
            if (strlen(f->name) == nlen && !strncmp(f->name, a, nlen)) break;
        if (!f->name) {
            fprintf(stderr, "%s: unknown flag '--%.*s' (see --help)\n", prog, (int)nlen, a);
            return -1;
        }
        const char *v = NULL;
        if (eq) v = eq + 1;
        else if (f->type == PRISM_FLAG_TYPE_BOOL) v = "true";
        else if (i + 1 < argc) v = argv[++i];
        else {
            fprintf(stderr, "%s: flag '--%s' needs a value\n", prog, f->name);
            return -1;
        }
        if (set_value(f, v) != 0) {
            fprintf(stderr, "%s: bad value '%s' for --%s\n", prog, v, f->name);
            return -1;
        }
    }
    return 0;
}
