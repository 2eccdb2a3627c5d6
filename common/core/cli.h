/* cli: table-driven command-line flags with generated --help.
 *
 *   static char *model = "models/x"; static int64_t port = 8000; static bool verbose;
 *   prism_flag_t flags[] = {
 *       PRISM_FLAG_STR("model-path", &model, "Model directory"),
 *       PRISM_FLAG_INT("port", &port, "Port to listen on"),
 *       PRISM_FLAG_BOOL("verbose", &verbose, "More logs"),
 *       PRISM_FLAG_END,
 *   };
 *   int rc = prism_cli_parse(argc, argv, "router", "OpenAI-compatible front end", flags);
 *   // rc > 0: --help was printed, exit 0; rc < 0: error printed, exit 2.
 *
 * Flags are --name value or --name=value; repeated STR_LIST flags accumulate.
 */
#ifndef PRISM_CLI_H
#define PRISM_CLI_H

#include "core/core.h"

typedef enum {
    PRISM_FLAG_TYPE_STR,
    PRISM_FLAG_TYPE_INT,
    PRISM_FLAG_TYPE_DOUBLE,
    PRISM_FLAG_TYPE_BOOL,
    PRISM_FLAG_TYPE_BYTES,     /* int64 parsed with prism_parse_bytes ("512M") */
    PRISM_FLAG_TYPE_STR_LIST,  /* repeated and/or comma-separated */
} prism_flag_type_t;

#define PRISM_CLI_MAX_LIST 16

typedef struct {
    const char *items[PRISM_CLI_MAX_LIST];
    int n;
} prism_str_list_t;

typedef struct {
    const char *name;
    prism_flag_type_t type;
    void *target;
    const char *help;
} prism_flag_t;

#define PRISM_FLAG_STR(n, p, h)    {(n), PRISM_FLAG_TYPE_STR, (p), (h)}
#define PRISM_FLAG_INT(n, p, h)    {(n), PRISM_FLAG_TYPE_INT, (p), (h)}
#define PRISM_FLAG_DOUBLE(n, p, h) {(n), PRISM_FLAG_TYPE_DOUBLE, (p), (h)}
#define PRISM_FLAG_BOOL(n, p, h)   {(n), PRISM_FLAG_TYPE_BOOL, (p), (h)}
#define PRISM_FLAG_BYTES(n, p, h)  {(n), PRISM_FLAG_TYPE_BYTES, (p), (h)}
#define PRISM_FLAG_LIST(n, p, h)   {(n), PRISM_FLAG_TYPE_STR_LIST, (p), (h)}
#define PRISM_FLAG_END             {NULL, 0, NULL, NULL}

int prism_cli_parse(int argc, char **argv, const char *prog, const char *summary, prism_flag_t *flags);

#endif
