/* prism_supervisor: runs the processes a spec file names and keeps them running (policy in
 * supervisor.h). deploy/launch.sh writes the spec into its run directory and runs this. */
#include "supervisor.h"

#include "core/cli.h"
#include "core/core.h"

#include <stdio.h>

int main(int argc, char **argv)
{
    prism_supervisor_opts_t o = prism_supervisor_opts_default();
    const char *spec_path = NULL, *run_dir = NULL, *log_dir = NULL, *log_level = "info";
    bool fail_fast = false, exit_with_parent = false;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("spec", &spec_path, "Process list: one per line, NAME<TAB>PROGRAM<TAB>ARG..."),
        PRISM_FLAG_STR("run-dir", &run_dir, "Directory for NAME.pid files (required)"),
        PRISM_FLAG_STR("log-dir", &log_dir, "Append each process's output to DIR/NAME.log (default: inherit ours)"),
        PRISM_FLAG_DOUBLE("backoff-initial", &o.backoff_initial_s, "Seconds before the first restart of a process"),
        PRISM_FLAG_DOUBLE("backoff-max", &o.backoff_max_s, "Longest wait between restarts (the delay doubles up to it)"),
        PRISM_FLAG_DOUBLE("healthy-after", &o.healthy_after_s, "A run this long resets the backoff"),
        PRISM_FLAG_DOUBLE("grace", &o.grace_s, "Seconds between SIGTERM and SIGKILL when stopping"),
        PRISM_FLAG_BOOL("fail-fast", &fail_fast,
                        "Stop everything when a first run exits non-zero within --healthy-after (a configuration error)"),
        PRISM_FLAG_BOOL("exit-with-parent", &exit_with_parent, "Stop everything when our parent process dies"),
        PRISM_FLAG_STR("log-level", &log_level, "debug, info, warn or error"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_supervisor",
                             "Prism process supervisor: restarts a process that dies (exponential backoff, reset "
                             "after a healthy run), never stops the rest because one died, and stops everything "
                             "on SIGINT/SIGTERM (SIGTERM, then SIGKILL after --grace).",
                             flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("prism_supervisor", prism_log_level_parse(log_level));
    if (!spec_path || !run_dir) {
        fprintf(stderr, "prism_supervisor: --spec and --run-dir are required (see --help)\n");
        return 2;
    }
    if (!(o.backoff_initial_s > 0) || o.backoff_max_s < o.backoff_initial_s || o.backoff_max_s > 86400 ||
        !(o.healthy_after_s >= 0) || !(o.grace_s >= 0) || o.grace_s > 86400) {
        fprintf(stderr, "prism_supervisor: need 0 < --backoff-initial <= --backoff-max <= 86400, "
                        "--healthy-after >= 0, 0 <= --grace <= 86400\n");
        return 2;
    }
    o.fail_fast = fail_fast;
    o.exit_with_parent = exit_with_parent;
    o.run_dir = run_dir;
    o.log_dir = log_dir;

    char *text = NULL, err[256] = "";
    size_t len = 0;
    rc = prism_read_file(spec_path, PRISM_SUPERVISOR_MAX_SPEC_BYTES, &text, &len);
    if (rc != PRISM_OK) {
        PRISM_ERROR("cannot read the spec %s: %s", spec_path, prism_strerror(rc));
        return 2;
    }
    prism_supervisor_spec_t spec;
    rc = prism_supervisor_spec_parse(text, len, &spec, err, sizeof(err));
    prism_free(text);
    if (rc != PRISM_OK) {
        PRISM_ERROR("%s: %s", spec_path, err);
        return 2;
    }
    rc = prism_supervisor_run(&spec, &o);
    prism_supervisor_spec_free(&spec);
    return rc;
}
