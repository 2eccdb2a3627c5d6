/* Process supervisor: spec parsing, the backoff policy and the one loop that owns the children.
 * Signals are blocked and taken synchronously with sigtimedwait, so the loop is the only place
 * that reacts to them: no handler races a restart or a reap. */
#include "supervisor.h"

#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- options, policy */

prism_supervisor_opts_t prism_supervisor_opts_default(void)
{
    return (prism_supervisor_opts_t){
        .backoff_initial_s = 0.5,
        .backoff_max_s = 30.0,
        .healthy_after_s = 30.0,
        .grace_s = 10.0,
        .fail_fast = false,
        .exit_with_parent = false,
        .run_dir = NULL,
        .log_dir = NULL,
    };
}

double prism_supervisor_backoff_s(const prism_supervisor_opts_t *o, int failures)
{
    PRISM_ASSERT(failures >= 1);
    double d = o->backoff_initial_s;
    for (int i = 1; i < failures && d < o->backoff_max_s; i++) d *= 2;
    return PRISM_MIN(d, o->backoff_max_s);
}

double prism_supervisor_on_exit(const prism_supervisor_opts_t *o, prism_supervisor_proc_t *p, double run_s)
{
    /* A run that stayed up for the healthy period was not a crash loop: start counting afresh. */
    if (run_s >= o->healthy_after_s) p->failures = 1;
    else if (p->failures < 64) p->failures++;
    return prism_supervisor_backoff_s(o, p->failures);
}

/* ---------------------------------------------------------------- spec */

static bool valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 63) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-'))
            return false;
    }
    return s[0] != '.';
}

int prism_supervisor_spec_parse(const char *text, size_t len, prism_supervisor_spec_t *spec, char *err,
                                size_t err_len)
{
    memset(spec, 0, sizeof(*spec));
    int rc = PRISM_OK;
    if (len > PRISM_SUPERVISOR_MAX_SPEC_BYTES) {
        snprintf(err, err_len, "spec is %zu bytes; at most %u", len, PRISM_SUPERVISOR_MAX_SPEC_BYTES);
        return PRISM_ELIMIT;
    }
    if (memchr(text, 0, len)) {
        snprintf(err, err_len, "spec holds a NUL byte");
        return PRISM_EINVAL;
    }
    spec->text = prism_malloc(len + 1);
    spec->procs = prism_calloc(PRISM_SUPERVISOR_MAX_PROCS, sizeof(*spec->procs));
    if (!spec->text || !spec->procs) {
        rc = PRISM_ENOMEM;
        snprintf(err, err_len, "out of memory");
        goto fail;
    }
    memcpy(spec->text, text, len);
    spec->text[len] = 0;
    int line_no = 0;
    char *line = spec->text;
    while (line) {
        line_no++;
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        char *next = nl ? nl + 1 : NULL;
        size_t ll = strlen(line);
        if (ll && line[ll - 1] == '\r') line[--ll] = 0;
        if (ll == 0 || line[0] == '#') {
            line = next;
            continue;
        }
        if (spec->n == PRISM_SUPERVISOR_MAX_PROCS) {
            rc = PRISM_ELIMIT;
            snprintf(err, err_len, "line %d: more than %d processes", line_no, PRISM_SUPERVISOR_MAX_PROCS);
            goto fail;
        }
        int nf = 1;
        for (char *c = line; *c; c++) nf += *c == '\t';
        if (nf < 2) {
            rc = PRISM_EINVAL;
            snprintf(err, err_len, "line %d: expected NAME<TAB>PROGRAM[<TAB>ARG...]", line_no);
            goto fail;
        }
        if (nf - 1 > PRISM_SUPERVISOR_MAX_ARGS) {
            rc = PRISM_ELIMIT;
            snprintf(err, err_len, "line %d: more than %d arguments", line_no, PRISM_SUPERVISOR_MAX_ARGS);
            goto fail;
        }
        prism_supervisor_proc_t *p = &spec->procs[spec->n];
        p->argv = prism_calloc((size_t)nf, sizeof(char *));  /* nf - 1 fields + NULL */
        if (!p->argv) {
            rc = PRISM_ENOMEM;
            snprintf(err, err_len, "out of memory");
            goto fail;
        }
        spec->n++;
        char *f = line;
        for (int i = 0; i < nf; i++) {
            char *tab = strchr(f, '\t');
            if (tab) *tab = 0;
            if (i == 0) {
                if (!valid_name(f)) {
                    rc = PRISM_EINVAL;
                    snprintf(err, err_len, "line %d: bad name '%.80s' (1..63 of A-Z a-z 0-9 . _ -)", line_no, f);
                    goto fail;
                }
                snprintf(p->name, sizeof(p->name), "%s", f);
            } else {
                p->argv[p->argc++] = f;
            }
            f = tab ? tab + 1 : NULL;
        }
        if (!*p->argv[0]) {
            rc = PRISM_EINVAL;
            snprintf(err, err_len, "line %d: empty program", line_no);
            goto fail;
        }
        for (int j = 0; j + 1 < spec->n; j++)
            if (!strcmp(spec->procs[j].name, p->name)) {
                rc = PRISM_EINVAL;
                snprintf(err, err_len, "line %d: name '%s' used twice", line_no, p->name);
                goto fail;
            }
        line = next;
    }
    if (spec->n == 0) {
        rc = PRISM_EINVAL;
        snprintf(err, err_len, "spec names no process");
        goto fail;
    }
    return PRISM_OK;
fail:
    prism_supervisor_spec_free(spec);
    return rc;
}

void prism_supervisor_spec_free(prism_supervisor_spec_t *spec)
{
    if (spec->procs)
        for (int i = 0; i < spec->n; i++) prism_free(spec->procs[i].argv);
    prism_free(spec->procs);
    prism_free(spec->text);
    memset(spec, 0, sizeof(*spec));
}

/* ---------------------------------------------------------------- the loop */

typedef struct {
    prism_supervisor_spec_t *spec;
    const prism_supervisor_opts_t *o;
    pid_t self;
    int stop_rc;        /* -1 while running */
    double kill_at_s;   /* when stopping: SIGKILL what is left at this time */
    bool killed;
} sv_t;

static int pid_path(const sv_t *s, const prism_supervisor_proc_t *p, const char *suffix, char *out, size_t n)
{
    int w = snprintf(out, n, "%s/%s.pid%s", s->o->run_dir, p->name, suffix);
    return w > 0 && (size_t)w < n ? PRISM_OK : PRISM_ELIMIT;
}

static int pid_file_write(const sv_t *s, const prism_supervisor_proc_t *p)
{
    char tmp[4096], path[4096];
    if (pid_path(s, p, ".tmp", tmp, sizeof(tmp)) || pid_path(s, p, "", path, sizeof(path))) return PRISM_ELIMIT;
    /* never through a link another user planted (the run directory is checked to be ours too) */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno == EEXIST && unlink(tmp) == 0)
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return PRISM_EIO;
    char line[32];
    int len = snprintf(line, sizeof line, "%d\n", (int)p->pid);
    bool ok = write(fd, line, (size_t)len) == len;
    ok = (close(fd) == 0) && ok;
    /* rename: a reader sees the old pid or the new one, never a half-written file */
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return PRISM_EIO;
    }
    return PRISM_OK;
}

static void pid_file_remove(const sv_t *s, const prism_supervisor_proc_t *p)
{
    char path[4096];
    if (pid_path(s, p, "", path, sizeof(path)) == PRISM_OK) unlink(path);
}

static const int k_stop_signals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

static _Noreturn void child_exec(const sv_t *s, const prism_supervisor_proc_t *p, const char *log_path)
{
    /* Own process group: a terminal's Ctrl-C goes to the supervisor only, and the whole group
     * (helpers a process forks, such as nginx's workers) can be killed at once. */
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != s->self) _exit(0);  /* the supervisor died before prctl took effect */
    signal(SIGPIPE, SIG_DFL);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(k_stop_signals); i++) signal(k_stop_signals[i], SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    int in = open("/dev/null", O_RDONLY);
    if (in >= 0) {
        dup2(in, 0);
        if (in > 2) close(in);
    }
    if (log_path) {
        /* not through a link, and only into a file of ours (as root we could append to any file) */
        char why[256];
        int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd >= 0 && prism_fd_trusted(fd, log_path, why, sizeof why) != PRISM_OK) {
            dprintf(2, "prism_supervisor: %s: not logging there\n", why);
            close(fd);
            fd = -1;
        }
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
    }
    execvp(p->argv[0], p->argv);
    dprintf(2, "prism_supervisor: cannot run %s for %s: %s\n", p->argv[0], p->name, strerror(errno));
    _exit(127);
}

static void schedule(sv_t *s, prism_supervisor_proc_t *p, double delay)
{
    p->restart_at_s = prism_now_s() + delay;
    PRISM_INFO("%s: start again in %.2fs (%d in a row)", p->name, delay, p->failures);
}

static int start(sv_t *s, prism_supervisor_proc_t *p)
{
    char log_path[4096];
    const char *lp = NULL;
    if (s->o->log_dir) {
        int w = snprintf(log_path, sizeof(log_path), "%s/%s.log", s->o->log_dir, p->name);
        if (w > 0 && (size_t)w < sizeof(log_path)) lp = log_path;
    }
    p->restart_at_s = 0;
    pid_t pid = fork();
    if (pid < 0) {
        PRISM_ERROR("%s: fork failed: %s", p->name, strerror(errno));
        schedule(s, p, prism_supervisor_on_exit(s->o, p, 0));
        return PRISM_EIO;
    }
    if (pid == 0) child_exec(s, p, lp);
    setpgid(pid, pid);  /* also here, so a kill(-pid) right after fork cannot miss */
    p->pid = pid;
    p->started_s = prism_now_s();
    p->runs++;
    if (pid_file_write(s, p) != PRISM_OK)
        PRISM_WARN("%s: cannot write its pid file in %s: %s", p->name, s->o->run_dir, strerror(errno));
    PRISM_INFO("%s: started (pid %d%s)", p->name, (int)pid, p->runs > 1 ? ", a restart" : "");
    return PRISM_OK;
}

static void begin_stop(sv_t *s, int rc)
{
    if (s->stop_rc >= 0) return;
    s->stop_rc = rc;
    int n = 0;
    for (int i = 0; i < s->spec->n; i++) {
        prism_supervisor_proc_t *p = &s->spec->procs[i];
        p->restart_at_s = 0;
        if (!p->pid) continue;
        kill(p->pid, SIGTERM);
        n++;
    }
    s->kill_at_s = prism_now_s() + s->o->grace_s;
    PRISM_INFO("stopping: SIGTERM to %d process%s, SIGKILL to what is left in %.1fs", n, n == 1 ? "" : "es",
               s->o->grace_s);
}

static void on_child_exit(sv_t *s, prism_supervisor_proc_t *p, int status)
{
    double run_s = prism_now_s() - p->started_s;
    pid_t pid = p->pid;
    p->pid = 0;
    pid_file_remove(s, p);
    /* Whatever the process left in its group (helpers it forked) goes with it: a stray nginx
     * worker would keep the port the next run needs. */
    kill(-pid, SIGKILL);
    char how[64];
    if (WIFSIGNALED(status)) snprintf(how, sizeof(how), "killed by signal %d", WTERMSIG(status));
    else snprintf(how, sizeof(how), "exited with status %d", WEXITSTATUS(status));
    if (s->stop_rc >= 0) {
        PRISM_INFO("%s (pid %d) %s", p->name, (int)pid, how);
        return;
    }
    PRISM_WARN("%s (pid %d) %s after %.2fs", p->name, (int)pid, how, run_s);
    if (s->o->fail_fast && p->runs == 1 && WIFEXITED(status) && WEXITSTATUS(status) != 0 &&
        WEXITSTATUS(status) != PRISM_EXIT_PEER_LOST && run_s < s->o->healthy_after_s) {
        PRISM_ERROR("%s failed at start-up (%s): a configuration error, not a crash; stopping everything "
                    "(its log says why)", p->name, how);
        begin_stop(s, 1);
        return;
    }
    schedule(s, p, prism_supervisor_on_exit(s->o, p, run_s));
}

static void reap(sv_t *s)
{
    for (;;) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        for (int i = 0; i < s->spec->n; i++)
            if (s->spec->procs[i].pid == pid) {
                on_child_exit(s, &s->spec->procs[i], status);
                break;
            }
    }
}

static int n_running(const sv_t *s)
{
    int n = 0;
    for (int i = 0; i < s->spec->n; i++) n += s->spec->procs[i].pid != 0;
    return n;
}

int prism_supervisor_run(prism_supervisor_spec_t *spec, const prism_supervisor_opts_t *o)
{
    PRISM_ASSERT(o->run_dir && o->backoff_initial_s > 0 && o->backoff_max_s >= o->backoff_initial_s);
    sv_t s = {.spec = spec, .o = o, .self = getpid(), .stop_rc = -1};
    if (access(o->run_dir, W_OK) != 0) {
        PRISM_ERROR("run directory %s is not writable: %s", o->run_dir, strerror(errno));
        return 2;
    }
    if (o->log_dir && access(o->log_dir, W_OK) != 0) {
        PRISM_ERROR("log directory %s is not writable: %s", o->log_dir, strerror(errno));
        return 2;
    }
    /* Directories another local user may change would let them aim our writes (as root, at any
     * file) through links named like our pid files and logs (issue 26). */
    char why[512];
    if (prism_dir_trusted(o->run_dir, why, sizeof why) != PRISM_OK ||
        (o->log_dir && prism_dir_trusted(o->log_dir, why, sizeof why) != PRISM_OK)) {
        PRISM_ERROR("%s", why);
        return 2;
    }
    /* A launcher's background job starts with SIGINT ignored and may have SIGCHLD ignored (which
     * would reap children behind our back): take every disposition back before blocking. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    signal(SIGCHLD, SIG_DFL);
    for (size_t i = 0; i < PRISM_ARRAY_LEN(k_stop_signals); i++) {
        signal(k_stop_signals[i], SIG_DFL);
        sigaddset(&set, k_stop_signals[i]);
    }
    signal(SIGPIPE, SIG_IGN);
    sigprocmask(SIG_BLOCK, &set, NULL);
    if (o->exit_with_parent) {
        pid_t parent = getppid();
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (parent == 1) raise(SIGTERM);  /* orphaned already: pending, taken by the loop */
    }

    for (int i = 0; i < spec->n && s.stop_rc < 0; i++) start(&s, &spec->procs[i]);
    for (;;) {
        double now = prism_now_s();
        if (s.stop_rc < 0)
            for (int i = 0; i < spec->n; i++) {
                prism_supervisor_proc_t *p = &spec->procs[i];
                if (!p->pid && p->restart_at_s > 0 && now >= p->restart_at_s) start(&s, p);
            }
        if (s.stop_rc >= 0 && n_running(&s) == 0) break;
        if (s.stop_rc >= 0 && !s.killed && now >= s.kill_at_s) {
            for (int i = 0; i < spec->n; i++) {
                prism_supervisor_proc_t *p = &spec->procs[i];
                if (!p->pid) continue;
                PRISM_WARN("%s (pid %d) still running %.1fs after SIGTERM: SIGKILL", p->name, (int)p->pid, o->grace_s);
                kill(-p->pid, SIGKILL);
                kill(p->pid, SIGKILL);
            }
            s.killed = true;
        }
        double next = now + 3600;
        if (s.stop_rc < 0) {
            for (int i = 0; i < spec->n; i++)
                if (!spec->procs[i].pid && spec->procs[i].restart_at_s > 0)
                    next = PRISM_MIN(next, spec->procs[i].restart_at_s);
        } else if (!s.killed) {
            next = PRISM_MIN(next, s.kill_at_s);
        }
        double wait_s = PRISM_MAX(0.0, next - now);
        struct timespec ts = {.tv_sec = (time_t)wait_s, .tv_nsec = (long)((wait_s - floor(wait_s)) * 1e9)};
        siginfo_t info;
        int sig = sigtimedwait(&set, &info, &ts);
        if (sig > 0 && sig != SIGCHLD) {
            if (s.stop_rc < 0) {
                PRISM_INFO("signal %d: stopping every process", sig);
                begin_stop(&s, 0);
            } else {
                PRISM_INFO("signal %d: already stopping", sig);
            }
        }
        reap(&s);
    }
    for (int i = 0; i < spec->n; i++) pid_file_remove(&s, &spec->procs[i]);
    PRISM_INFO("stopped");
    return s.stop_rc;
}
