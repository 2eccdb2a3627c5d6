/* supervisor: keeps a set of processes running on one host (what deploy/launch.sh runs).
 *
 *   prism_supervisor_spec_t spec;
 *   prism_supervisor_spec_parse(text, len, &spec, err, sizeof(err));   // text is kept by spec
 *   prism_supervisor_opts_t o = prism_supervisor_opts_default();
 *   int rc = prism_supervisor_run(&spec, &o);                           // returns when stopped
 *   prism_supervisor_spec_free(&spec);
 *
 * Policy (the same as the systemd units' Restart= and Kubernetes' CrashLoopBackOff):
 *  - a process that exits, for any reason, is started again after a delay that doubles with each
 *    consecutive short run (backoff_initial_s, 2x, 4x, ... capped at backoff_max_s); a run that
 *    lasted healthy_after_s or longer resets the count, so the next restart waits backoff_initial_s;
 *  - one process dying never stops the others;
 *  - SIGINT, SIGTERM, SIGHUP or SIGQUIT stops everything: SIGTERM to every process, SIGKILL to the
 *    process group of whatever is still alive grace_s later;
 *  - with fail_fast, a first run that exits non-zero (not by a signal) before healthy_after_s is a
 *    configuration error (bad flag, missing model, port in use): everything stops, run returns 1.
 *    Except status PRISM_EXIT_PEER_LOST: a group member whose peer died (restarted like a crash).
 *
 * Each process runs in its own process group (so a terminal's Ctrl-C reaches only the supervisor,
 * which then stops the processes in order) and gets SIGTERM if the supervisor dies. Its pid is in
 * run_dir/NAME.pid while it runs (replaced atomically on restart, removed at the end); with
 * log_dir its stdout and stderr are appended to log_dir/NAME.log, otherwise inherited.
 *
 * Spec text: one process per line, fields separated by TAB: NAME, program, arguments. Empty lines
 * and lines starting with '#' are ignored. NAME is 1..63 characters of [A-Za-z0-9._-], unique.
 * No quoting: arguments may hold spaces, never a TAB or a newline. */
#ifndef PRISM_SUPERVISOR_H
#define PRISM_SUPERVISOR_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define PRISM_SUPERVISOR_MAX_PROCS 256
#define PRISM_SUPERVISOR_MAX_ARGS 255
#define PRISM_SUPERVISOR_MAX_SPEC_BYTES (1u << 20)

typedef struct {
    char name[64];
    char **argv;          /* NULL-terminated; strings point into the spec's text */
    int argc;
    /* run state, owned by prism_supervisor_run */
    pid_t pid;            /* 0 while not running */
    double started_s;     /* monotonic start of the current run */
    double restart_at_s;  /* > 0: start again at this monotonic time */
    int failures;         /* consecutive runs shorter than healthy_after_s */
    int runs;             /* starts so far */
} prism_supervisor_proc_t;

typedef struct {
    prism_supervisor_proc_t *procs;
    int n;
    char *text;           /* owned copy of the spec text, split in place */
} prism_supervisor_spec_t;

typedef struct {
    double backoff_initial_s;
    double backoff_max_s;
    double healthy_after_s;
    double grace_s;
    bool fail_fast;
    bool exit_with_parent;  /* stop everything when our parent dies (a launcher killed by SIGKILL) */
    const char *run_dir;    /* pid files; required */
    const char *log_dir;    /* NULL: children inherit our stdout and stderr */
} prism_supervisor_opts_t;

prism_supervisor_opts_t prism_supervisor_opts_default(void);

/* Parses len bytes of spec text (copied). Returns PRISM_OK, or PRISM_EINVAL / PRISM_ELIMIT with a
 * message naming the line in err. */
int prism_supervisor_spec_parse(const char *text, size_t len, prism_supervisor_spec_t *spec, char *err,
                                size_t err_len);
void prism_supervisor_spec_free(prism_supervisor_spec_t *spec);

/* Delay before the next start of a process that has failed `failures` times in a row (>= 1). */
double prism_supervisor_backoff_s(const prism_supervisor_opts_t *o, int failures);

/* Accounts for the end of a run that lasted run_s seconds: updates p->failures and returns the delay
 * before the next start. */
double prism_supervisor_on_exit(const prism_supervisor_opts_t *o, prism_supervisor_proc_t *p, double run_s);

/* Starts every process and keeps them running until a stop signal. Returns 0 after a requested
 * stop, 1 after a fail_fast stop, 2 when nothing could be started. */
int prism_supervisor_run(prism_supervisor_spec_t *spec, const prism_supervisor_opts_t *o);

#endif
