/* Builtins: jinja2's filters and tests (with HF's tojson), Python str/dict/list methods, and the
 * globals transformers installs (raise_exception, strftime_now, namespace, dict) plus range. */
#include "template/tpl_internal.h"

#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <wctype.h>

/* ------------------------------------------------------------------ tables */

enum {
    F_ABS, F_ATTR, F_CAPITALIZE, F_CENTER, F_COUNT, F_DEFAULT, F_DICTSORT, F_ESCAPE, F_FIRST, F_FLOAT, F_FORMAT,
    F_INDENT, F_INT, F_ITEMS, F_JOIN, F_LAST, F_LENGTH, F_LIST, F_LOWER, F_MAP, F_MAX, F_MIN, F_REJECT,
    F_REJECTATTR, F_REPLACE, F_REVERSE, F_ROUND, F_SAFE, F_SELECT, F_SELECTATTR, F_SORT, F_STRING, F_SUM,
    F_TITLE, F_TOJSON, F_TRIM, F_UNIQUE, F_UPPER, F_WORDCOUNT,
};

static const struct { const char *name; int id; } filters[] = {
    {"abs", F_ABS}, {"attr", F_ATTR}, {"capitalize", F_CAPITALIZE}, {"center", F_CENTER}, {"count", F_COUNT},
    {"d", F_DEFAULT}, {"default", F_DEFAULT}, {"dictsort", F_DICTSORT}, {"e", F_ESCAPE}, {"escape", F_ESCAPE},
    {"forceescape", F_ESCAPE}, {"first", F_FIRST}, {"float", F_FLOAT}, {"format", F_FORMAT},
    {"indent", F_INDENT}, {"int", F_INT}, {"items", F_ITEMS}, {"join", F_JOIN}, {"last", F_LAST},
    {"length", F_LENGTH}, {"list", F_LIST}, {"lower", F_LOWER}, {"map", F_MAP}, {"max", F_MAX}, {"min", F_MIN},
    {"reject", F_REJECT}, {"rejectattr", F_REJECTATTR}, {"replace", F_REPLACE}, {"reverse", F_REVERSE},
    {"round", F_ROUND}, {"safe", F_SAFE}, {"select", F_SELECT}, {"selectattr", F_SELECTATTR}, {"sort", F_SORT},
    {"string", F_STRING}, {"sum", F_SUM}, {"title", F_TITLE}, {"tojson", F_TOJSON}, {"trim", F_TRIM},
    {"unique", F_UNIQUE}, {"upper", F_UPPER}, {"wordcount", F_WORDCOUNT},
};

enum {
    T_BOOLEAN, T_CALLABLE, T_DEFINED, T_DIVISIBLEBY, T_EQ, T_ESCAPED, T_EVEN, T_FALSE, T_FLOAT, T_GE, T_GT, T_IN,
    T_INTEGER, T_ITERABLE, T_LE, T_LOWER, T_LT, T_MAPPING, T_NE, T_NONE, T_NUMBER, T_ODD, T_SAMEAS, T_SEQUENCE,
    T_STRING, T_TRUE, T_UNDEFINED, T_UPPER,
};

static const struct { const char *name; int id; } tests[] = {
    {"boolean", T_BOOLEAN}, {"callable", T_CALLABLE}, {"defined", T_DEFINED}, {"divisibleby", T_DIVISIBLEBY},
    {"eq", T_EQ}, {"equalto", T_EQ}, {"==", T_EQ}, {"escaped", T_ESCAPED}, {"even", T_EVEN}, {"false", T_FALSE},
    {"float", T_FLOAT}, {"ge", T_GE}, {">=", T_GE}, {"gt", T_GT}, {"greaterthan", T_GT}, {">", T_GT}, {"in", T_IN},
    {"integer", T_INTEGER}, {"iterable", T_ITERABLE}, {"le", T_LE}, {"<=", T_LE}, {"lower", T_LOWER},
    {"lt", T_LT}, {"lessthan", T_LT}, {"<", T_LT}, {"mapping", T_MAPPING}, {"ne", T_NE}, {"!=", T_NE},
    {"none", T_NONE}, {"number", T_NUMBER}, {"odd", T_ODD}, {"sameas", T_SAMEAS}, {"sequence", T_SEQUENCE},
    {"string", T_STRING}, {"true", T_TRUE}, {"undefined", T_UNDEFINED}, {"upper", T_UPPER},
};

enum {
    /* str */
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_RSPLIT, M_SPLITLINES, M_STARTSWITH, M_ENDSWITH, M_UPPER, M_LOWER,
    M_TITLE, M_CAPITALIZE, M_REPLACE, M_FIND, M_RFIND, M_INDEX_S, M_RINDEX, M_COUNT_S, M_JOIN, M_ISDIGIT,
    M_ISALPHA, M_ISALNUM, M_ISSPACE, M_ISUPPER, M_ISLOWER, M_REMOVEPREFIX, M_REMOVESUFFIX,
    /* dict */
    M_ITEMS, M_KEYS, M_VALUES, M_GET, M_COPY_D,
    /* list / tuple */
    M_INDEX_L, M_COUNT_L, M_COPY_L,
    /* loop */
    M_CYCLE,
    /* sandbox-blocked mutators: calling them fails like ImmutableSandboxedEnvironment does */
    M_UNSAFE_BASE = 100,
};

static const char *const str_methods[] = {
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "upper", "lower",
    "title", "capitalize", "replace", "find", "rfind", "index", "rindex", "count", "join", "isdigit", "isalpha",
    "isalnum", "isspace", "isupper", "islower", "removeprefix", "removesuffix",
};
static const char *const dict_methods[] = {"items", "keys", "values", "get", "copy"};
static const char *const dict_unsafe[] = {"pop", "popitem", "setdefault", "update", "clear"};
static const char *const list_unsafe[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"};
/* Python methods of str/dict/list the interpreter does not implement: compile rejects calls to them. */
static const char *const unsupported_methods[] = {
    "format", "format_map", "encode", "expandtabs", "translate", "maketrans", "casefold", "partition",
    "rpartition", "zfill", "ljust", "rjust", "center", "swapcase", "isidentifier", "isprintable", "isdecimal",
    "isnumeric", "isascii", "istitle", "fromkeys", "changed",
};

int tpl_filter_lookup(const char *name)
{
    for (size_t i = 0; i < PRISM_ARRAY_LEN(filters); i++)
        if (!strcmp(filters[i].name, name)) return filters[i].id;
    return -1;
}

int tpl_test_lookup(const char *name)
{
    for (size_t i = 0; i < PRISM_ARRAY_LEN(tests); i++)
        if (!strcmp(tests[i].name, name)) return tests[i].id;
    return -1;
}

static int find_name(const char *const *tab, size_t n, const char *name, size_t len)
{
    for (size_t i = 0; i < n; i++)
        if (strlen(tab[i]) == len && !memcmp(tab[i], name, len)) return (int)i;
    return -1;
}

int tpl_method_status(const char *name)
{
    size_t n = strlen(name);
    if (find_name(str_methods, PRISM_ARRAY_LEN(str_methods), name, n) >= 0 ||
        find_name(dict_methods, PRISM_ARRAY_LEN(dict_methods), name, n) >= 0 ||
        find_name(dict_unsafe, PRISM_ARRAY_LEN(dict_unsafe), name, n) >= 0 ||
        find_name(list_unsafe, PRISM_ARRAY_LEN(list_unsafe), name, n) >= 0 || !strcmp(name, "cycle"))
        return 1;
    if (find_name(unsupported_methods, PRISM_ARRAY_LEN(unsupported_methods), name, n) >= 0) return -1;
    return 0;
}

bool tpl_global_unsupported(const char *name)
{
    return !strcmp(name, "lipsum") || !strcmp(name, "cycler") || !strcmp(name, "joiner");
}

static const char *const globals[] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};
enum { G_RANGE, G_NAMESPACE, G_DICT, G_RAISE, G_STRFTIME };

int tpl_global_lookup(const char *name)
{
    return find_name(globals, PRISM_ARRAY_LEN(globals), name, strlen(name));
}

int tpl_method_lookup(tv_t recv, const char *name, size_t n)
{
    int i;
    if (n && name[0] == '_') return -1;
    if (recv.t == TV_STR) return find_name(str_methods, PRISM_ARRAY_LEN(str_methods), name, n);
    if (recv.t != TV_OBJ) return -1;
    tobj_t *o = recv.u.o;
    if (o->kind == OBJ_DICT) {
        if ((i = find_name(dict_methods, PRISM_ARRAY_LEN(dict_methods), name, n)) >= 0) return M_ITEMS + i;
        if ((i = find_name(dict_unsafe, PRISM_ARRAY_LEN(dict_unsafe), name, n)) >= 0) return M_UNSAFE_BASE + i;
        return -1;
    }
    if (o->kind == OBJ_LIST && (o->sub == SEQ_LIST || o->sub == SEQ_TUPLE || o->sub == SEQ_RANGE)) {
        if (n == 5 && !memcmp(name, "index", 5)) return M_INDEX_L;
        if (n == 5 && !memcmp(name, "count", 5)) return M_COUNT_L;
        if (o->sub == SEQ_LIST) {
            if (n == 4 && !memcmp(name, "copy", 4)) return M_COPY_L;
            if ((i = find_name(list_unsafe, PRISM_ARRAY_LEN(list_unsafe), name, n)) >= 0) return M_UNSAFE_BASE + 10 + i;
        }
        return -1;
    }
    if (o->kind == OBJ_LOOP && n == 5 && !memcmp(name, "cycle", 5)) return M_CYCLE;
    return -1;
}

const char *tpl_func_name(const tobj_t *f)
{
    if (f->sub == FN_GLOBAL && f->fid >= 0 && f->fid < (int)PRISM_ARRAY_LEN(globals)) return globals[f->fid];
    if (f->sub == FN_METHOD) {
        int id = f->fid;
        if (id >= M_UNSAFE_BASE + 10) return list_unsafe[id - M_UNSAFE_BASE - 10];
        if (id >= M_UNSAFE_BASE) return dict_unsafe[id - M_UNSAFE_BASE];
        if (id <= M_REMOVESUFFIX) return str_methods[id];
        if (id <= M_COPY_D) return dict_methods[id - M_ITEMS];
        if (id == M_INDEX_L) return "index";
        if (id == M_COUNT_L) return "count";
        if (id == M_COPY_L) return "copy";
        if (id == M_CYCLE) return "cycle";
    }
    return "function";
}

/* ------------------------------------------------------------------ helpers */

static bool undef(tv_t v) { return v.t == TV_UNDEF || v.t == TV_MISSING; }

static int undef_err(tpl_rctx_t *c, tv_t v)
{
    return tpl_fail(c, PRISM_EINVAL, "'%s' is undefined", v.u.uname ? v.u.uname : "value");
}

/* Binds positional + keyword arguments to params; absent ones are TV_MISSING. */
static int bind(tpl_rctx_t *c, const char *fname, const tpl_args_t *a, int np, const char *const *params, tv_t *out)
{
    for (int i = 0; i < np; i++) out[i] = tv_missing();
    if (a->nargs > np) return tpl_fail(c, PRISM_EINVAL, "%s() takes at most %d argument(s) (%d given)", fname, np, a->nargs);
    for (int i = 0; i < a->nargs; i++) out[i] = a->args[i];
    for (int k = 0; k < a->nkw; k++) {
        int idx = -1;
        for (int i = 0; i < np; i++)
            if (!strcmp(params[i], a->kwn[k])) { idx = i; break; }
        if (idx < 0) return tpl_fail(c, PRISM_EINVAL, "%s() got an unexpected keyword argument '%s'", fname, a->kwn[k]);
        if (out[idx].t != TV_MISSING) return tpl_fail(c, PRISM_EINVAL, "%s() got multiple values for argument '%s'", fname, a->kwn[k]);
        out[idx] = a->kwv[k];
    }
    return 0;
}

#define BIND(fname, ...)                                                                     \
    static const char *const params_[] = {__VA_ARGS__};                                      \
    tv_t p[PRISM_ARRAY_LEN(params_)];                                                       \
    if (bind(c, fname, a, (int)PRISM_ARRAY_LEN(params_), params_, p)) return c->status

static bool given(tv_t v) { return v.t != TV_MISSING; }

static int need_str(tpl_rctx_t *c, tv_t v, const char *what)
{
    if (v.t != TV_STR) return tpl_fail(c, PRISM_EINVAL, "%s must be str, not %s", what, tpl_type_name(v));
    return 0;
}

static int need_int(tpl_rctx_t *c, tv_t v, const char *what)
{
    if (!tv_is_intlike(v))
        return tpl_fail(c, PRISM_EINVAL, "'%s' object cannot be interpreted as an integer (%s)", tpl_type_name(v), what);
    return 0;
}

static tobj_t *new_iter(tpl_rctx_t *c, size_t cap) { return tpl_list_new(c, SEQ_ITER, cap); }

/* ---- unicode case mapping (Python str.upper/lower over the C.UTF-8 locale's simple mappings) */
static locale_t g_utf8_locale;
static pthread_once_t g_locale_once = PTHREAD_ONCE_INIT;
static void locale_init(void) { g_utf8_locale = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0); }

static uint32_t cp_upper(uint32_t cp)
{
    if (cp < 0x80) return (cp >= 'a' && cp <= 'z') ? cp - 32 : cp;
    pthread_once(&g_locale_once, locale_init);
    return g_utf8_locale ? (uint32_t)towupper_l((wint_t)cp, g_utf8_locale) : cp;
}

static uint32_t cp_lower(uint32_t cp)
{
    if (cp < 0x80) return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
    pthread_once(&g_locale_once, locale_init);
    return g_utf8_locale ? (uint32_t)towlower_l((wint_t)cp, g_utf8_locale) : cp;
}

static bool cp_isalpha(uint32_t cp)
{
    if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
    pthread_once(&g_locale_once, locale_init);
    return g_utf8_locale && iswalpha_l((wint_t)cp, g_utf8_locale);
}

static bool cp_isdigit(uint32_t cp) { return cp >= '0' && cp <= '9'; }

static bool cp_isalnum(uint32_t cp)
{
    if (cp < 0x80) return cp_isalpha(cp) || cp_isdigit(cp);
    pthread_once(&g_locale_once, locale_init);
    return g_utf8_locale && iswalnum_l((wint_t)cp, g_utf8_locale);
}

static bool cp_isupper(uint32_t cp) { return cp_lower(cp) != cp; }
static bool cp_islower(uint32_t cp) { return cp_upper(cp) != cp; }
static bool cp_iscased(uint32_t cp) { return cp_isupper(cp) || cp_islower(cp); }

enum { CASE_UPPER, CASE_LOWER, CASE_CAPITALIZE, CASE_PYTITLE, CASE_JTITLE };

static bool jtitle_sep(uint32_t cp)
{
    return cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || tpl_py_isspace(cp);
}

static int case_map(tpl_rctx_t *c, tv_t s, int mode, tv_t *out)
{
    tpl_sb_t b = {0};
    if (tpl_sb_reserve(c, &b, s.u.s.n + 8)) return c->status;
    bool first = true, prev_cased = false, at_start = true;
    for (size_t i = 0; i < s.u.s.n;) {
        uint32_t cp, m;
        i += prism_utf8_decode(s.u.s.p + i, s.u.s.n - i, &cp);
        switch (mode) {
        case CASE_UPPER: m = cp_upper(cp); break;
        case CASE_LOWER: m = cp_lower(cp); break;
        case CASE_CAPITALIZE: m = first ? cp_upper(cp) : cp_lower(cp); break;
        case CASE_PYTITLE:
            m = prev_cased ? cp_lower(cp) : cp_upper(cp);
            prev_cased = cp_iscased(cp);
            break;
        default:
            if (jtitle_sep(cp)) { m = cp; at_start = true; }
            else if (at_start) { m = cp_upper(cp); at_start = false; }
            else m = cp_lower(cp);
        }
        first = false;
        char enc[4];
        if (tpl_sb_add(c, &b, enc, prism_utf8_encode(m, enc))) return c->status;
    }
    *out = tpl_sb_value(&b);
    return 0;
}

static int str_of(tpl_rctx_t *c, tv_t v, tv_t *out) { return tpl_to_str(c, v, out); }

/* Python str.strip family. chars: TV_MISSING/None -> whitespace. which: 1 left, 2 right, 3 both. */
static int do_strip(tpl_rctx_t *c, tv_t s, tv_t chars, int which, tv_t *out)
{
    bool ws = chars.t == TV_MISSING || chars.t == TV_NONE;
    if (!ws && need_str(c, chars, "strip arg")) return c->status;
    const char *p = s.u.s.p;
    size_t a = 0, b = s.u.s.n;
    for (;;) {
        if (!(which & 1) || a >= b) break;
        uint32_t cp;
        size_t k = prism_utf8_decode(p + a, b - a, &cp);
        bool hit;
        if (ws) hit = tpl_py_isspace(cp);
        else {
            char enc[4];
            size_t el = prism_utf8_encode(cp, enc);
            hit = tpl_memfind(chars.u.s.p, chars.u.s.n, enc, el) != NULL;
        }
        if (!hit) break;
        a += k;
    }
    while ((which & 2) && b > a) {
        size_t st = b - 1;
        while (st > a && ((unsigned char)p[st] & 0xC0) == 0x80 && b - st < 4) st--;
        uint32_t cp;
        prism_utf8_decode(p + st, b - st, &cp);
        bool hit;
        if (ws) hit = tpl_py_isspace(cp);
        else {
            char enc[4];
            size_t el = prism_utf8_encode(cp, enc);
            hit = tpl_memfind(chars.u.s.p, chars.u.s.n, enc, el) != NULL;
        }
        if (!hit) break;
        b = st;
    }
    *out = tv_str(p + a, b - a);
    return 0;
}

static size_t ws_at(const char *p, size_t n)
{
    if (!n) return 0;
    uint32_t cp;
    size_t k = prism_utf8_decode(p, n, &cp);
    return tpl_py_isspace(cp) ? k : 0;
}

/* Python str.split / rsplit */
static int do_split(tpl_rctx_t *c, tv_t s, tv_t sep, tv_t maxsplit, bool right, tv_t *out)
{
    int64_t max = -1;
    if (given(maxsplit) && maxsplit.t != TV_NONE) {
        if (need_int(c, maxsplit, "maxsplit")) return c->status;
        max = maxsplit.u.i;
    }
    tobj_t *l = tpl_list_new(c, SEQ_LIST, 4);
    if (!l) return c->status;
    const char *p = s.u.s.p;
    size_t n = s.u.s.n;
    if (!given(sep) || sep.t == TV_NONE) {
        if (!right) {
            size_t i = 0;
            int64_t splits = 0;
            for (;;) {
                size_t k;
                while (i < n && (k = ws_at(p + i, n - i))) i += k;
                if (i >= n) break;
                if (max >= 0 && splits >= max) { /* the rest keeps its trailing whitespace, as in Python */
                    if (tpl_list_push(c, l, tv_str(p + i, n - i))) return c->status;
                    break;
                }
                size_t st = i;
                while (i < n && !ws_at(p + i, n - i)) {
                    uint32_t cp;
                    i += prism_utf8_decode(p + i, n - i, &cp);
                }
                if (tpl_list_push(c, l, tv_str(p + st, i - st))) return c->status;
                splits++;
            }
        } else {
            /* collect words from the right */
            tobj_t *tmp = tpl_list_new(c, SEQ_LIST, 4);
            if (!tmp) return c->status;
            size_t e = n;
            int64_t splits = 0;
            for (;;) {
                while (e > 0) {
                    size_t st = e - 1;
                    while (st > 0 && ((unsigned char)p[st] & 0xC0) == 0x80 && e - st < 4) st--;
                    if (ws_at(p + st, e - st) == e - st) e = st; else break;
                }
                if (e == 0) break;
                if (max >= 0 && splits >= max) {
                    if (tpl_list_push(c, tmp, tv_str(p, e))) return c->status;
                    break;
                }
                size_t b = e;
                while (b > 0) {
                    size_t st = b - 1;
                    while (st > 0 && ((unsigned char)p[st] & 0xC0) == 0x80 && b - st < 4) st--;
                    if (ws_at(p + st, b - st) == b - st) break;
                    b = st;
                }
                if (tpl_list_push(c, tmp, tv_str(p + b, e - b))) return c->status;
                splits++;
                e = b;
            }
            for (size_t i = tmp->len; i > 0; i--)
                if (tpl_list_push(c, l, tmp->items[i - 1])) return c->status;
        }
        *out = tv_obj(l);
        return 0;
    }
    if (need_str(c, sep, "separator")) return c->status;
    if (!sep.u.s.n) return tpl_fail(c, PRISM_EINVAL, "empty separator");
    const char *q = sep.u.s.p;
    size_t qn = sep.u.s.n;
    if (!right) {
        size_t i = 0;
        int64_t splits = 0;
        for (;;) {
            const char *f = (max < 0 || splits < max) ? tpl_memfind(p + i, n - i, q, qn) : NULL;
            if (!f) {
                if (tpl_list_push(c, l, tv_str(p + i, n - i))) return c->status;
                break;
            }
            size_t at = (size_t)(f - p);
            if (tpl_list_push(c, l, tv_str(p + i, at - i))) return c->status;
            i = at + qn;
            splits++;
        }
    } else {
        tobj_t *tmp = tpl_list_new(c, SEQ_LIST, 4);
        if (!tmp) return c->status;
        size_t e = n;
        int64_t splits = 0;
        for (;;) {
            const char *f = NULL;
            if (max < 0 || splits < max) {
                /* last occurrence in [0, e) */
                for (size_t j = e >= qn ? e - qn + 1 : 0; j > 0; j--)
                    if (!memcmp(p + j - 1, q, qn)) { f = p + j - 1; break; }
            }
            if (!f) {
                if (tpl_list_push(c, tmp, tv_str(p, e))) return c->status;
                break;
            }
            size_t at = (size_t)(f - p);
            if (tpl_list_push(c, tmp, tv_str(p + at + qn, e - at - qn))) return c->status;
            e = at;
            splits++;
        }
        for (size_t i = tmp->len; i > 0; i--)
            if (tpl_list_push(c, l, tmp->items[i - 1])) return c->status;
    }
    *out = tv_obj(l);
    return 0;
}

/* Python str.splitlines line boundaries: returns the length of the break at p (0 if none). */
static size_t line_break_at(const char *p, size_t n)
{
    unsigned char ch = (unsigned char)p[0];
    if (ch == '\r') return (n > 1 && p[1] == '\n') ? 2 : 1;
    if (ch == '\n' || ch == 0x0b || ch == 0x0c || ch == 0x1c || ch == 0x1d || ch == 0x1e) return 1;
    if (ch >= 0x80) {
        uint32_t cp;
        size_t k = prism_utf8_decode(p, n, &cp);
        if (cp == 0x85 || cp == 0x2028 || cp == 0x2029) return k;
    }
    return 0;
}

static int do_splitlines(tpl_rctx_t *c, tv_t s, bool keepends, tobj_t **out)
{
    tobj_t *l = tpl_list_new(c, SEQ_LIST, 4);
    if (!l) return c->status;
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, st = 0, i = 0;
    while (i < n) {
        size_t k = line_break_at(p + i, n - i);
        if (!k) { i++; continue; }
        if (tpl_list_push(c, l, tv_str(p + st, (keepends ? i + k : i) - st))) return c->status;
        i += k;
        st = i;
    }
    if (st < n && tpl_list_push(c, l, tv_str(p + st, n - st))) return c->status;
    *out = l;
    return 0;
}

static int do_replace(tpl_rctx_t *c, tv_t s, tv_t old, tv_t new_, int64_t count, tv_t *out)
{
    tpl_sb_t b = {0};
    const char *p = s.u.s.p;
    size_t n = s.u.s.n, i = 0;
    int64_t done = 0;
    if (!old.u.s.n) {
        /* empty pattern: insert before every code point and at the end */
        while (count < 0 || done < count) {
            if (tpl_sb_add(c, &b, new_.u.s.p, new_.u.s.n)) return c->status;
            done++;
            if (i >= n) break;
            uint32_t cp;
            size_t k = prism_utf8_decode(p + i, n - i, &cp);
            if (tpl_sb_add(c, &b, p + i, k)) return c->status;
            i += k;
        }
        if (tpl_sb_add(c, &b, p + i, n - i)) return c->status;
        *out = tpl_sb_value(&b);
        return c->status;
    }
    while (count < 0 || done < count) {
        const char *f = tpl_memfind(p + i, n - i, old.u.s.p, old.u.s.n);
        if (!f) break;
        size_t at = (size_t)(f - p);
        if (tpl_sb_add(c, &b, p + i, at - i) || tpl_sb_add(c, &b, new_.u.s.p, new_.u.s.n)) return c->status;
        i = at + old.u.s.n;
        done++;
    }
    if (!done) { *out = s; return 0; }
    if (tpl_sb_add(c, &b, p + i, n - i)) return c->status;
    *out = tpl_sb_value(&b);
    return c->status;
}

static bool starts_with(tv_t s, tv_t pre) { return pre.u.s.n <= s.u.s.n && !memcmp(s.u.s.p, pre.u.s.p, pre.u.s.n); }
static bool ends_with(tv_t s, tv_t suf)
{
    return suf.u.s.n <= s.u.s.n && !memcmp(s.u.s.p + s.u.s.n - suf.u.s.n, suf.u.s.p, suf.u.s.n);
}

static int affix_test(tpl_rctx_t *c, tv_t s, tv_t arg, bool end, bool *res)
{
    if (arg.t == TV_STR) { *res = end ? ends_with(s, arg) : starts_with(s, arg); return 0; }
    if (tv_is_seq(arg, SEQ_TUPLE)) {
        *res = false;
        for (size_t i = 0; i < arg.u.o->len; i++) {
            tv_t x = arg.u.o->items[i];
            if (x.t != TV_STR)
                return tpl_fail(c, PRISM_EINVAL, "tuple for %swith must only contain str, not %s", end ? "ends" : "starts", tpl_type_name(x));
            if (end ? ends_with(s, x) : starts_with(s, x)) { *res = true; break; }
        }
        return 0;
    }
    return tpl_fail(c, PRISM_EINVAL, "%swith first arg must be str or a tuple of str, not %s", end ? "ends" : "starts",
                    tpl_type_name(arg));
}

static int64_t cp_index_of(const char *p, size_t byte_off) { return (int64_t)prism_utf8_count(p, byte_off); }

/* ------------------------------------------------------------------ attribute getters (make_attrgetter) */

typedef struct {
    int nparts;
    tv_t parts[16];
} attrpath_t;

static int prepare_attr(tpl_rctx_t *c, tv_t attr, attrpath_t *ap)
{
    ap->nparts = 0;
    if (!given(attr) || attr.t == TV_NONE) return 0;
    if (attr.t != TV_STR) {
        ap->parts[ap->nparts++] = attr;
        return 0;
    }
    const char *p = attr.u.s.p;
    size_t n = attr.u.s.n, st = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && p[i] != '.') continue;
        if (ap->nparts >= 16) return tpl_fail(c, PRISM_ELIMIT, "attribute path too long");
        bool digits = i > st;
        int64_t v = 0;
        for (size_t j = st; j < i; j++) {
            if (p[j] < '0' || p[j] > '9' || v > (INT64_MAX / 10 - 10)) { digits = false; break; }
            v = v * 10 + (p[j] - '0');
        }
        ap->parts[ap->nparts++] = digits ? tv_int(v) : tv_str(p + st, i - st);
        st = i + 1;
    }
    return 0;
}

static int apply_attr(tpl_rctx_t *c, const attrpath_t *ap, tv_t item, tv_t deflt, tv_t *out)
{
    for (int i = 0; i < ap->nparts; i++) {
        if (tpl_getitem(c, item, ap->parts[i], &item)) return c->status;
        if (given(deflt) && deflt.t != TV_NONE && undef(item)) item = deflt;
    }
    *out = item;
    return 0;
}

static tv_t ignore_case(tpl_rctx_t *c, tv_t v)
{
    if (v.t != TV_STR) return v;
    tv_t r;
    if (case_map(c, v, CASE_LOWER, &r)) return v;
    return r;
}

/* ------------------------------------------------------------------ sorting (stable merge sort) */

typedef struct {
    tv_t key;
    tv_t item;
} sortent_t;

static int sort_entries(tpl_rctx_t *c, sortent_t *v, size_t n, bool reverse)
{
    if (n < 2) return 0;
    sortent_t *tmp = tpl_alloc(c, n * sizeof(*tmp));
    if (!tmp) return c->status;
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = PRISM_MIN(lo + width, n), hi = PRISM_MIN(lo + 2 * width, n);
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                int r;
                if (tpl_cmp(c, v[j].key, v[i].key, &r, 0)) return c->status;
                if (reverse) r = -r;
                /* take from the right only when strictly smaller: keeps equal keys in order */
                if (r < 0) tmp[k++] = v[j++];
                else tmp[k++] = v[i++];
            }
            while (i < mid) tmp[k++] = v[i++];
            while (j < hi) tmp[k++] = v[j++];
        }
        memcpy(v, tmp, n * sizeof(*v));
    }
    return 0;
}

/* ------------------------------------------------------------------ number parsing (Python int()/float()) */

static bool parse_py_int(const char *s, size_t n, int base, int64_t *out)
{
    size_t i = 0;
    while (i < n && ws_at(s + i, n - i)) i += ws_at(s + i, n - i);
    while (n > i && ws_at(s + n - 1, 1)) n--;
    /* trailing multi-byte whitespace is rare; treat it as invalid */
    bool neg = false;
    if (i < n && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    if (i + 1 < n && s[i] == '0') {
        char p = (char)(s[i + 1] | 0x20);
        int pb = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
        if (pb && (base == 0 || base == pb)) { base = pb; i += 2; if (i < n && s[i] == '_') i++; }
    }
    if (base == 0) base = 10;
    if (i >= n) return false;
    uint64_t v = 0;
    bool prev_us = true;
    for (; i < n; i++) {
        char ch = s[i];
        if (ch == '_') { if (prev_us) return false; prev_us = true; continue; }
        int d = (ch >= '0' && ch <= '9') ? ch - '0' : ((ch | 0x20) >= 'a' && (ch | 0x20) <= 'z') ? (ch | 0x20) - 'a' + 10 : 99;
        if (d >= base) return false;
        if (v > (uint64_t)INT64_MAX / (uint64_t)base) return false;
        v = v * (uint64_t)base + (uint64_t)d;
        if (v > (uint64_t)INT64_MAX) return false;
        prev_us = false;
    }
    if (prev_us) return false;
    *out = neg ? -(int64_t)v : (int64_t)v;
    return true;
}

static bool parse_py_float(const char *s, size_t n, double *out)
{
    size_t i = 0;
    while (i < n && ws_at(s + i, n - i)) i += ws_at(s + i, n - i);
    while (n > i && ws_at(s + n - 1, 1)) n--;
    if (i >= n || n - i > 400) return false;
    char buf[420];
    size_t o = 0;
    for (size_t j = i; j < n; j++) {
        char ch = s[j];
        if (ch == '_') {
            if (j == i || j + 1 >= n || !(s[j - 1] >= '0' && s[j - 1] <= '9') || !(s[j + 1] >= '0' && s[j + 1] <= '9'))
                return false;
            continue;
        }
        if (ch == 'x' || ch == 'X' || ch == '(' || ch == 'p' || ch == 'P') return false;
        buf[o++] = ch;
    }
    buf[o] = 0;
    char *end;
    double v = strtod(buf, &end);
    if (end != buf + o || o == 0) return false;
    *out = v;
    return true;
}

/* Python round(x, nd) for floats: correctly rounded, ties to even on the exact binary value. */
static double py_round(double x, int64_t nd)
{
    if (!isfinite(x) || nd > 320) return x;
    if (nd >= 0) {
        char buf[400];
        snprintf(buf, sizeof(buf), "%.*f", (int)nd, x);
        return strtod(buf, NULL);
    }
    if (nd < -320) return copysign(0.0, x);
    double p = pow(10.0, (double)-nd);
    double y = x / p;
    double r = nearbyint(y); /* default rounding mode: ties to even */
    return r * p;
}

/* ------------------------------------------------------------------ filters */

static int escape_html(tpl_rctx_t *c, tv_t s, tv_t *out)
{
    tpl_sb_t b = {0};
    for (size_t i = 0; i < s.u.s.n; i++) {
        char ch = s.u.s.p[i];
        const char *r = NULL;
        switch (ch) {
        case '&': r = "&amp;"; break;
        case '<': r = "&lt;"; break;
        case '>': r = "&gt;"; break;
        case '"': r = "&#34;"; break;
        case '\'': r = "&#39;"; break;
        }
        if (r ? tpl_sb_add(c, &b, r, strlen(r)) : tpl_sb_addc(c, &b, ch)) return c->status;
    }
    *out = tpl_sb_value(&b);
    return 0;
}

static int filt_indent(tpl_rctx_t *c, tv_t s, const tpl_args_t *a, tv_t *out)
{
    BIND("indent", "width", "first", "blank");
    tv_t ind;
    if (!given(p[0])) ind = tv_str("    ", 4);
    else if (p[0].t == TV_STR) ind = p[0];
    else {
        if (need_int(c, p[0], "width")) return c->status;
        tv_t sp = tv_str(" ", 1);
        if (tpl_binop(c, OP_MUL, sp, p[0], &ind)) return c->status;
    }
    bool first = given(p[1]) && tpl_truthy(p[1]), blank = given(p[2]) && tpl_truthy(p[2]);
    tpl_sb_t t = {0};
    if (tpl_sb_add(c, &t, s.u.s.p, s.u.s.n) || tpl_sb_addc(c, &t, '\n')) return c->status;
    tobj_t *lines;
    if (do_splitlines(c, tpl_sb_value(&t), false, &lines)) return c->status;
    tpl_sb_t b = {0};
    if (first && tpl_sb_add(c, &b, ind.u.s.p, ind.u.s.n)) return c->status;
    for (size_t i = 0; i < lines->len; i++) {
        tv_t ln = lines->items[i];
        if (i) {
            if (tpl_sb_addc(c, &b, '\n')) return c->status;
            if ((blank || ln.u.s.n) && tpl_sb_add(c, &b, ind.u.s.p, ind.u.s.n)) return c->status;
        }
        if (tpl_sb_add(c, &b, ln.u.s.p, ln.u.s.n)) return c->status;
    }
    *out = tpl_sb_value(&b);
    return 0;
}

static int filt_tojson(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("tojson", "ensure_ascii", "indent", "separators", "sort_keys");
    tpl_json_opts_t o;
    memset(&o, 0, sizeof(o));
    o.ensure_ascii = given(p[0]) && tpl_truthy(p[0]);
    o.sort_keys = given(p[3]) && tpl_truthy(p[3]);
    if (given(p[1]) && p[1].t != TV_NONE) {
        if (p[1].t != TV_STR && !tv_is_intlike(p[1]))
            return tpl_fail(c, PRISM_EINVAL, "can't multiply sequence by non-int of type '%s'", tpl_type_name(p[1]));
        o.has_indent = true;
        o.indent = p[1];
    }
    o.item_sep = o.has_indent ? "," : ", ";
    o.key_sep = ": ";
    if (given(p[2]) && p[2].t != TV_NONE) {
        if (!tv_is_list(p[2]) || p[2].u.o->len != 2 || p[2].u.o->items[0].t != TV_STR || p[2].u.o->items[1].t != TV_STR)
            return tpl_fail(c, PRISM_EINVAL, "tojson separators must be a pair of strings");
        o.item_sep = p[2].u.o->items[0].u.s.p;
        o.item_sep_n = p[2].u.o->items[0].u.s.n;
        o.key_sep = p[2].u.o->items[1].u.s.p;
        o.key_sep_n = p[2].u.o->items[1].u.s.n;
    } else {
        o.item_sep_n = strlen(o.item_sep);
        o.key_sep_n = strlen(o.key_sep);
    }
    tpl_sb_t b = {0};
    if (tpl_write_json(c, &b, v, &o, 0, 0)) return c->status;
    *out = tpl_sb_value(&b);
    return 0;
}

/* select / reject / selectattr / rejectattr */
static int filt_select(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, bool attr, bool keep_if, tv_t *out, int line)
{
    int off = 0;
    attrpath_t ap = {0};
    if (attr) {
        if (a->nargs < 1) return tpl_fail(c, PRISM_EINVAL, "Missing parameter for attribute name");
        if (prepare_attr(c, a->args[0], &ap)) return c->status;
        off = 1;
    }
    int test = -1;
    if (a->nargs > off) {
        tv_t name = a->args[off];
        if (name.t != TV_STR) return tpl_fail(c, PRISM_EINVAL, "test name must be a string");
        char tn[32];
        if (name.u.s.n >= sizeof(tn) || memchr(name.u.s.p, 0, name.u.s.n))
            return tpl_fail(c, PRISM_EINVAL, "No test named '%.*s'.", (int)PRISM_MIN(name.u.s.n, 64), name.u.s.p);
        memcpy(tn, name.u.s.p, name.u.s.n);
        tn[name.u.s.n] = 0;
        if ((test = tpl_test_lookup(tn)) < 0) return tpl_fail(c, PRISM_EINVAL, "No test named '%s'.", tn);
    }
    tpl_args_t ta = {a->nargs > off + 1 ? a->nargs - off - 1 : 0, a->args + off + 1, a->nkw, a->kwn, a->kwv};
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    tobj_t *r = new_iter(c, items->len);
    if (!r) return c->status;
    for (size_t i = 0; i < items->len; i++) {
        tv_t x = items->items[i];
        if (attr && apply_attr(c, &ap, x, tv_missing(), &x)) return c->status;
        bool ok;
        if (test >= 0) {
            if (tpl_apply_test(c, test, x, &ta, &ok, line)) return c->status;
        } else {
            ok = tpl_truthy(x);
        }
        if (ok == keep_if) r->items[r->len++] = items->items[i];
    }
    *out = tv_obj(r);
    return 0;
}

static int filt_map(tpl_rctx_t *c, tpl_scope_t *s, tv_t v, const tpl_args_t *a, tv_t *out, int line)
{
    tobj_t *items;
    attrpath_t ap = {0};
    tv_t deflt = tv_missing();
    int fid = -1;
    tpl_args_t fa = {0};
    if (a->nargs == 0) {
        tv_t attr = tv_missing();
        for (int k = 0; k < a->nkw; k++) {
            if (!strcmp(a->kwn[k], "attribute")) attr = a->kwv[k];
            else if (!strcmp(a->kwn[k], "default")) deflt = a->kwv[k];
            else return tpl_fail(c, PRISM_EINVAL, "Unexpected keyword argument '%s'", a->kwn[k]);
        }
        if (!given(attr)) return tpl_fail(c, PRISM_EINVAL, "map requires a filter argument");
        if (prepare_attr(c, attr, &ap)) return c->status;
    } else {
        tv_t name = a->args[0];
        char fnm[32];
        if (name.t != TV_STR || name.u.s.n >= sizeof(fnm) || memchr(name.u.s.p, 0, name.u.s.n))
            return tpl_fail(c, PRISM_EINVAL, "map: invalid filter name");
        memcpy(fnm, name.u.s.p, name.u.s.n);
        fnm[name.u.s.n] = 0;
        if ((fid = tpl_filter_lookup(fnm)) < 0) return tpl_fail(c, PRISM_EINVAL, "No filter named '%s'.", fnm);
        fa.nargs = a->nargs - 1;
        fa.args = a->args + 1;
        fa.nkw = a->nkw;
        fa.kwn = a->kwn;
        fa.kwv = a->kwv;
    }
    if (tpl_iterate(c, v, &items)) return c->status;
    tobj_t *r = new_iter(c, items->len);
    if (!r) return c->status;
    for (size_t i = 0; i < items->len; i++) {
        tv_t x = items->items[i];
        if (fid >= 0) {
            if (tpl_apply_filter(c, s, fid, x, &fa, &x, line)) return c->status;
        } else if (apply_attr(c, &ap, x, deflt, &x)) {
            return c->status;
        }
        r->items[r->len++] = x;
    }
    *out = tv_obj(r);
    return 0;
}

/* key for sort/unique/min/max: attribute path then optional lower-casing */
static int sort_key(tpl_rctx_t *c, const attrpath_t *aps, int naps, bool ci, tv_t item, tv_t *key)
{
    if (naps <= 1) {
        tv_t k = item;
        if (naps == 1 && apply_attr(c, &aps[0], item, tv_missing(), &k)) return c->status;
        *key = ci ? ignore_case(c, k) : k;
        return c->status;
    }
    tobj_t *t = tpl_list_new(c, SEQ_LIST, (size_t)naps);
    if (!t) return c->status;
    for (int i = 0; i < naps; i++) {
        tv_t k;
        if (apply_attr(c, &aps[i], item, tv_missing(), &k)) return c->status;
        t->items[t->len++] = ci ? ignore_case(c, k) : k;
    }
    *key = tv_obj(t);
    return 0;
}

/* "a,b.c" -> several attribute paths (sort's make_multi_attrgetter) */
static int prepare_multi_attr(tpl_rctx_t *c, tv_t attr, attrpath_t *aps, int *naps)
{
    *naps = 0;
    if (!given(attr) || attr.t == TV_NONE) return 0;
    if (attr.t != TV_STR) { *naps = 1; return prepare_attr(c, attr, &aps[0]); }
    size_t st = 0, n = attr.u.s.n;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && attr.u.s.p[i] != ',') continue;
        if (*naps >= 8) return tpl_fail(c, PRISM_ELIMIT, "too many sort attributes");
        if (prepare_attr(c, tv_str(attr.u.s.p + st, i - st), &aps[(*naps)++])) return c->status;
        st = i + 1;
    }
    return 0;
}

static int filt_sort(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("sort", "reverse", "case_sensitive", "attribute");
    attrpath_t aps[8];
    int naps;
    if (prepare_multi_attr(c, p[2], aps, &naps)) return c->status;
    bool ci = !(given(p[1]) && tpl_truthy(p[1]));
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    sortent_t *e = tpl_alloc(c, (items->len + 1) * sizeof(*e));
    if (!e) return c->status;
    for (size_t i = 0; i < items->len; i++) {
        e[i].item = items->items[i];
        if (sort_key(c, aps, naps, ci, e[i].item, &e[i].key)) return c->status;
    }
    if (sort_entries(c, e, items->len, given(p[0]) && tpl_truthy(p[0]))) return c->status;
    tobj_t *r = tpl_list_new(c, SEQ_LIST, items->len);
    if (!r) return c->status;
    for (size_t i = 0; i < items->len; i++) r->items[r->len++] = e[i].item;
    *out = tv_obj(r);
    return 0;
}

static int filt_dictsort(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("dictsort", "case_sensitive", "by", "reverse");
    int pos = 0;
    if (given(p[1])) {
        if (p[1].t == TV_STR && p[1].u.s.n == 5 && !memcmp(p[1].u.s.p, "value", 5)) pos = 1;
        else if (!(p[1].t == TV_STR && p[1].u.s.n == 3 && !memcmp(p[1].u.s.p, "key", 3)))
            return tpl_fail(c, PRISM_EINVAL, "You can only sort by either \"key\" or \"value\"");
    }
    if (!tv_is_dict(v)) return tpl_fail(c, PRISM_EINVAL, "dictsort: '%s' object has no attribute 'items'", tpl_type_name(v));
    bool ci = !(given(p[0]) && tpl_truthy(p[0]));
    tobj_t *d = v.u.o;
    sortent_t *e = tpl_alloc(c, (d->len + 1) * sizeof(*e));
    if (!e) return c->status;
    for (size_t i = 0; i < d->len; i++) {
        tobj_t *t = tpl_list_new(c, SEQ_TUPLE, 2);
        if (!t) return c->status;
        t->items[0] = d->items[i];
        t->items[1] = d->vals[i];
        t->len = 2;
        e[i].item = tv_obj(t);
        tv_t k = t->items[pos];
        e[i].key = ci ? ignore_case(c, k) : k;
    }
    if (sort_entries(c, e, d->len, given(p[2]) && tpl_truthy(p[2]))) return c->status;
    tobj_t *r = tpl_list_new(c, SEQ_LIST, d->len);
    if (!r) return c->status;
    for (size_t i = 0; i < d->len; i++) r->items[r->len++] = e[i].item;
    *out = tv_obj(r);
    return 0;
}

static bool hashable_key(tv_t v)
{
    if (v.t != TV_OBJ) return true;
    if (tv_is_seq(v, SEQ_TUPLE)) {
        for (size_t i = 0; i < v.u.o->len; i++)
            if (!hashable_key(v.u.o->items[i])) return false;
        return true;
    }
    return v.u.o->kind != OBJ_LIST && v.u.o->kind != OBJ_DICT;
}

static int filt_unique(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("unique", "case_sensitive", "attribute");
    attrpath_t ap;
    if (prepare_attr(c, p[1], &ap)) return c->status;
    bool ci = !(given(p[0]) && tpl_truthy(p[0]));
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    tobj_t *r = new_iter(c, items->len);
    tv_t *seen = tpl_alloc(c, (items->len + 1) * sizeof(tv_t));
    if (!r || !seen) return c->status;
    size_t nseen = 0;
    for (size_t i = 0; i < items->len; i++) {
        tv_t k;
        if (sort_key(c, &ap, ap.nparts ? 1 : 0, ci, items->items[i], &k)) return c->status;
        if (!hashable_key(k)) return tpl_fail(c, PRISM_EINVAL, "unhashable type: '%s'", tpl_type_name(k));
        bool dup = false;
        for (size_t j = 0; j < nseen && !dup; j++) dup = tpl_eq(seen[j], k, 0);
        if (dup) continue;
        seen[nseen++] = k;
        r->items[r->len++] = items->items[i];
    }
    *out = tv_obj(r);
    return 0;
}

static int filt_minmax(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, bool want_max, tv_t *out)
{
    BIND(want_max ? "max" : "min", "case_sensitive", "attribute");
    attrpath_t ap;
    if (prepare_attr(c, p[1], &ap)) return c->status;
    bool ci = !(given(p[0]) && tpl_truthy(p[0]));
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    if (!items->len) { *out = tv_undef("No aggregated item, sequence was empty."); return 0; }
    size_t best = 0;
    tv_t bk;
    if (sort_key(c, &ap, ap.nparts ? 1 : 0, ci, items->items[0], &bk)) return c->status;
    for (size_t i = 1; i < items->len; i++) {
        tv_t k;
        int r;
        if (sort_key(c, &ap, ap.nparts ? 1 : 0, ci, items->items[i], &k)) return c->status;
        if (tpl_cmp(c, k, bk, &r, 0)) return c->status;
        if (want_max ? r > 0 : r < 0) { best = i; bk = k; }
    }
    *out = items->items[best];
    return 0;
}

static int filt_round(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("round", "precision", "method");
    int64_t prec = 0;
    if (given(p[0])) {
        if (need_int(c, p[0], "precision")) return c->status;
        prec = p[0].u.i;
    }
    int method = 0; /* common */
    if (given(p[1])) {
        tv_t m = p[1];
        if (m.t == TV_STR && m.u.s.n == 4 && !memcmp(m.u.s.p, "ceil", 4)) method = 1;
        else if (m.t == TV_STR && m.u.s.n == 5 && !memcmp(m.u.s.p, "floor", 5)) method = 2;
        else if (!(m.t == TV_STR && m.u.s.n == 6 && !memcmp(m.u.s.p, "common", 6)))
            return tpl_fail(c, PRISM_EINVAL, "method must be common, ceil or floor");
    }
    if (undef(v)) return undef_err(c, v);
    if (!tv_is_num(v)) return tpl_fail(c, PRISM_EINVAL, "type %s doesn't define __round__ method", tpl_type_name(v));
    if (method == 0) {
        if (v.t != TV_FLOAT) {
            if (prec >= 0) { *out = tv_int(v.u.i); return 0; }
            /* round(int, -n): to a multiple of 10**n, ties to even */
            if (prec < -18) { *out = tv_int(0); return 0; }
            int64_t m = 1;
            for (int64_t i = 0; i < -prec; i++) m *= 10;
            int64_t q = v.u.i / m, r = v.u.i % m;
            if (r < 0) { r += m; q -= 1; }
            if (2 * r > m || (2 * r == m && (q & 1))) q += 1;
            int64_t res;
            if (__builtin_mul_overflow(q, m, &res)) return tpl_fail(c, PRISM_ELIMIT, "integer overflow");
            *out = tv_int(res);
            return 0;
        }
        *out = tv_float(py_round(v.u.f, prec));
        return 0;
    }
    double x = v.t == TV_FLOAT ? v.u.f : (double)v.u.i;
    double scale = pow(10.0, (double)prec);
    double y = method == 1 ? ceil(x * scale) : floor(x * scale);
    *out = tv_float(y / scale);
    return 0;
}

static int filt_int(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("int", "default", "base");
    tv_t deflt = given(p[0]) ? p[0] : tv_int(0);
    int64_t base = 10;
    if (given(p[1])) {
        if (need_int(c, p[1], "base")) return c->status;
        base = p[1].u.i;
    }
    if (undef(v)) return undef_err(c, v);
    if (v.t == TV_STR) {
        int64_t r;
        if ((base == 0 || (base >= 2 && base <= 36)) && parse_py_int(v.u.s.p, v.u.s.n, (int)base, &r)) {
            *out = tv_int(r);
            return 0;
        }
        double f;
        if (parse_py_float(v.u.s.p, v.u.s.n, &f) && isfinite(f) && fabs(f) < 9.2e18) {
            *out = tv_int((int64_t)f);
            return 0;
        }
        *out = deflt;
        return 0;
    }
    if (tv_is_intlike(v)) { *out = tv_int(v.u.i); return 0; }
    if (v.t == TV_FLOAT) {
        if (isfinite(v.u.f) && fabs(v.u.f) < 9.2e18) *out = tv_int((int64_t)v.u.f);
        else *out = deflt;
        return 0;
    }
    *out = deflt;
    return 0;
}

static int filt_float(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("float", "default");
    tv_t deflt = given(p[0]) ? p[0] : tv_float(0.0);
    if (undef(v)) return undef_err(c, v);
    if (v.t == TV_STR) {
        double f;
        *out = parse_py_float(v.u.s.p, v.u.s.n, &f) ? tv_float(f) : deflt;
        return 0;
    }
    if (tv_is_intlike(v)) { *out = tv_float((double)v.u.i); return 0; }
    if (v.t == TV_FLOAT) { *out = v; return 0; }
    *out = deflt;
    return 0;
}

static int filt_center(tpl_rctx_t *c, tv_t s, const tpl_args_t *a, tv_t *out)
{
    BIND("center", "width");
    int64_t width = 80;
    if (given(p[0])) {
        if (need_int(c, p[0], "width")) return c->status;
        width = p[0].u.i;
    }
    int64_t len = (int64_t)prism_utf8_count(s.u.s.p, s.u.s.n);
    if (width <= len) { *out = s; return 0; }
    if (width > (int64_t)PRISM_TEMPLATE_MAX_OUTPUT) return tpl_fail(c, PRISM_ELIMIT, "center width too large");
    int64_t marg = width - len, left = marg / 2 + (marg & width & 1);
    tpl_sb_t b = {0};
    for (int64_t i = 0; i < left; i++) tpl_sb_addc(c, &b, ' ');
    tpl_sb_add(c, &b, s.u.s.p, s.u.s.n);
    for (int64_t i = 0; i < marg - left; i++) tpl_sb_addc(c, &b, ' ');
    *out = tpl_sb_value(&b);
    return c->status;
}

static int filt_format(tpl_rctx_t *c, tv_t s, const tpl_args_t *a, tv_t *out)
{
    if (a->nargs && a->nkw) return tpl_fail(c, PRISM_EINVAL, "can't handle positional and keyword arguments at the same time");
    tv_t args;
    if (a->nkw) {
        tobj_t *d = tpl_dict_new(c, OBJ_DICT, (size_t)a->nkw);
        if (!d) return c->status;
        for (int k = 0; k < a->nkw; k++)
            if (tpl_dict_set(c, d, tv_str(a->kwn[k], strlen(a->kwn[k])), a->kwv[k])) return c->status;
        args = tv_obj(d);
    } else {
        tobj_t *t = tpl_list_new(c, SEQ_TUPLE, (size_t)a->nargs);
        if (!t) return c->status;
        for (int i = 0; i < a->nargs; i++) t->items[t->len++] = a->args[i];
        args = tv_obj(t);
    }
    return tpl_format_printf(c, s, args, out);
}

static int filt_reverse(tpl_rctx_t *c, tv_t v, tv_t *out)
{
    if (v.t == TV_STR) {
        tobj_t *chars;
        if (tpl_iterate(c, v, &chars)) return c->status;
        tpl_sb_t b = {0};
        if (tpl_sb_reserve(c, &b, v.u.s.n)) return c->status;
        for (size_t i = chars->len; i > 0; i--) tpl_sb_add(c, &b, chars->items[i - 1].u.s.p, chars->items[i - 1].u.s.n);
        *out = tpl_sb_value(&b);
        return c->status;
    }
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    bool was_iter = tv_is_seq(v, SEQ_ITER);
    /* reversed() works on sequences and dicts (an iterator); generators fall back to a reversed list */
    tobj_t *r = was_iter ? tpl_list_new(c, SEQ_LIST, items->len) : new_iter(c, items->len);
    if (!r) return c->status;
    for (size_t i = items->len; i > 0; i--) r->items[r->len++] = items->items[i - 1];
    *out = tv_obj(r);
    return 0;
}

static int filt_join(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("join", "d", "attribute");
    tv_t sep = tv_str("", 0);
    if (given(p[0]) && tpl_to_str(c, p[0], &sep)) return c->status;
    attrpath_t ap;
    if (prepare_attr(c, p[1], &ap)) return c->status;
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    tpl_sb_t b = {0};
    for (size_t i = 0; i < items->len; i++) {
        tv_t x = items->items[i];
        if (ap.nparts && apply_attr(c, &ap, x, tv_missing(), &x)) return c->status;
        if (i && tpl_sb_add(c, &b, sep.u.s.p, sep.u.s.n)) return c->status;
        if (tpl_write_str(c, &b, x)) return c->status;
    }
    *out = tpl_sb_value(&b);
    return 0;
}

static int filt_sum(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("sum", "attribute", "start");
    attrpath_t ap;
    if (prepare_attr(c, p[0], &ap)) return c->status;
    tv_t acc = given(p[1]) ? p[1] : tv_int(0);
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    for (size_t i = 0; i < items->len; i++) {
        tv_t x = items->items[i];
        if (ap.nparts && apply_attr(c, &ap, x, tv_missing(), &x)) return c->status;
        if (tpl_binop(c, OP_ADD, acc, x, &acc)) return c->status;
    }
    *out = acc;
    return 0;
}

static int filt_wordcount(tpl_rctx_t *c, tv_t s, tv_t *out)
{
    int64_t n = 0;
    bool in_word = false;
    for (size_t i = 0; i < s.u.s.n;) {
        uint32_t cp;
        i += prism_utf8_decode(s.u.s.p + i, s.u.s.n - i, &cp);
        bool w = cp == '_' || cp_isalnum(cp);
        if (w && !in_word) n++;
        in_word = w;
    }
    *out = tv_int(n);
    (void)c;
    return 0;
}

static int filt_attr(tpl_rctx_t *c, tv_t v, const tpl_args_t *a, tv_t *out)
{
    BIND("attr", "name");
    if (!given(p[0])) return tpl_fail(c, PRISM_EINVAL, "attr() missing required argument 'name'");
    tv_t name;
    if (tpl_to_str(c, p[0], &name)) return c->status;
    if (undef(v)) return undef_err(c, v);
    char nm[64];
    if (name.u.s.n >= sizeof(nm) || memchr(name.u.s.p, 0, name.u.s.n)) { *out = tv_undef("attribute"); return 0; }
    memcpy(nm, name.u.s.p, name.u.s.n);
    nm[name.u.s.n] = 0;
    /* getattr() only: dict keys are not attributes */
    if (tv_is_dict(v)) {
        int fid = tpl_method_lookup(v, nm, name.u.s.n);
        if (fid < 0) { *out = tv_undef("attribute"); return 0; }
    }
    return tpl_getattr(c, v, nm, name.u.s.n, out);
}

/* jinja2's select/reject/map/unique/items are generator functions: nothing runs (and nothing fails)
 * until the result is iterated. They are computed eagerly here; a type error becomes a generator
 * that raises it when consumed. Limits are not deferred. */
static int lazy(tpl_rctx_t *c, int rc, tv_t *out)
{
    if (rc != PRISM_EINVAL) return rc;
    const char *msg = "error in generator";
    if (c->err && c->err[0]) {
        char *m = tpl_pool_strndup(&c->pool, c->err, strlen(c->err));
        if (m) msg = m;
        c->err[0] = 0;
    }
    c->status = 0;
    tobj_t *g = new_iter(c, 0);
    if (!g) return c->status;
    g->poison = msg;
    *out = tv_obj(g);
    return 0;
}

static int empty_iter(tpl_rctx_t *c, tv_t *out)
{
    tobj_t *g = new_iter(c, 0);
    if (!g) return c->status;
    *out = tv_obj(g);
    return 0;
}

int tpl_apply_filter(tpl_rctx_t *c, tpl_scope_t *s, int id, tv_t v, const tpl_args_t *a, tv_t *out, int line)
{
    tv_t sv;
    switch (id) {
    case F_ABS:
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "abs() takes no arguments");
        if (undef(v)) return undef_err(c, v);
        if (v.t == TV_FLOAT) { *out = tv_float(fabs(v.u.f)); return 0; }
        if (tv_is_intlike(v)) {
            if (v.u.i == INT64_MIN) return tpl_fail(c, PRISM_ELIMIT, "integer overflow");
            *out = tv_int(v.u.i < 0 ? -v.u.i : v.u.i);
            return 0;
        }
        return tpl_fail(c, PRISM_EINVAL, "bad operand type for abs(): '%s'", tpl_type_name(v));
    case F_ATTR: return filt_attr(c, v, a, out);
    case F_CAPITALIZE:
    case F_LOWER:
    case F_UPPER:
    case F_TITLE:
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "filter takes no arguments");
        if (str_of(c, v, &sv)) return c->status;
        return case_map(c, sv, id == F_CAPITALIZE ? CASE_CAPITALIZE : id == F_LOWER ? CASE_LOWER
                               : id == F_UPPER ? CASE_UPPER : CASE_JTITLE, out);
    case F_CENTER:
        if (str_of(c, v, &sv)) return c->status;
        return filt_center(c, sv, a, out);
    case F_COUNT:
    case F_LENGTH: {
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "length takes no arguments");
        int64_t n;
        if (tpl_len(c, v, &n)) return c->status;
        *out = tv_int(n);
        return 0;
    }
    case F_DEFAULT: {
        BIND("default", "default_value", "boolean");
        tv_t d = given(p[0]) ? p[0] : tv_str("", 0);
        bool boolean = given(p[1]) && tpl_truthy(p[1]);
        *out = (undef(v) || (boolean && !tpl_truthy(v))) ? d : v;
        return 0;
    }
    case F_DICTSORT: return filt_dictsort(c, v, a, out);
    case F_ESCAPE:
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "escape takes no arguments");
        if (str_of(c, v, &sv)) return c->status;
        return escape_html(c, sv, out);
    case F_FIRST: {
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "first takes no arguments");
        tobj_t *items;
        if (tpl_iterate(c, v, &items)) return c->status;
        *out = items->len ? items->items[0] : tv_undef("No first item, sequence was empty.");
        return 0;
    }
    case F_LAST: {
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "last takes no arguments");
        if (tv_is_seq(v, SEQ_ITER)) return tpl_fail(c, PRISM_EINVAL, "'generator' object is not reversible");
        tobj_t *items;
        if (tpl_iterate(c, v, &items)) return c->status;
        *out = items->len ? items->items[items->len - 1] : tv_undef("No last item, sequence was empty.");
        return 0;
    }
    case F_FLOAT: return filt_float(c, v, a, out);
    case F_FORMAT:
        if (str_of(c, v, &sv)) return c->status;
        return filt_format(c, sv, a, out);
    case F_INDENT:
        /* jinja2's indent appends "\n" to its input, so it needs a real string */
        if (undef(v)) return undef_err(c, v);
        if (v.t != TV_STR) return tpl_fail(c, PRISM_EINVAL, "unsupported operand type(s) for +=: '%s' and 'str'", tpl_type_name(v));
        return filt_indent(c, v, a, out);
    case F_INT: return filt_int(c, v, a, out);
    case F_ITEMS: {
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "items takes no arguments");
        if (undef(v)) { *out = tv_obj(new_iter(c, 0)); return c->status; }
        if (!tv_is_dict(v)) return lazy(c, tpl_fail(c, PRISM_EINVAL, "Can only get item pairs from a mapping."), out);
        tobj_t *d = v.u.o, *r = new_iter(c, d->len);
        if (!r) return c->status;
        for (size_t i = 0; i < d->len; i++) {
            tobj_t *t = tpl_list_new(c, SEQ_TUPLE, 2);
            if (!t) return c->status;
            t->items[0] = d->items[i];
            t->items[1] = d->vals[i];
            t->len = 2;
            r->items[r->len++] = tv_obj(t);
        }
        *out = tv_obj(r);
        return 0;
    }
    case F_JOIN: return filt_join(c, v, a, out);
    case F_LIST: {
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "list takes no arguments");
        tobj_t *items;
        if (tpl_iterate(c, v, &items)) return c->status;
        tobj_t *r = tpl_list_new(c, SEQ_LIST, items->len);
        if (!r) return c->status;
        if (items->len) memcpy(r->items, items->items, items->len * sizeof(tv_t));
        r->len = items->len;
        *out = tv_obj(r);
        return 0;
    }
    case F_MAP:
        if (!tpl_truthy(v)) return empty_iter(c, out); /* "if value:" guards the generator body */
        return lazy(c, filt_map(c, s, v, a, out, line), out);
    case F_MAX: return filt_minmax(c, v, a, true, out);
    case F_MIN: return filt_minmax(c, v, a, false, out);
    case F_REJECT:
    case F_REJECTATTR:
    case F_SELECT:
    case F_SELECTATTR:
        if (!tpl_truthy(v)) return empty_iter(c, out);
        return lazy(c, filt_select(c, v, a, id == F_SELECTATTR || id == F_REJECTATTR,
                                   id == F_SELECT || id == F_SELECTATTR, out, line), out);
    case F_REPLACE: {
        BIND("replace", "old", "new", "count");
        if (!given(p[0]) || !given(p[1])) return tpl_fail(c, PRISM_EINVAL, "replace() missing required arguments");
        tv_t o, nw;
        int64_t count = -1;
        if (given(p[2]) && p[2].t != TV_NONE) {
            if (need_int(c, p[2], "count")) return c->status;
            count = p[2].u.i;
        }
        if (str_of(c, v, &sv) || str_of(c, p[0], &o) || str_of(c, p[1], &nw)) return c->status;
        return do_replace(c, sv, o, nw, count, out);
    }
    case F_REVERSE:
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "reverse takes no arguments");
        return filt_reverse(c, v, out);
    case F_ROUND: return filt_round(c, v, a, out);
    case F_SAFE:
    case F_STRING:
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "filter takes no arguments");
        return str_of(c, v, out);
    case F_SORT: return filt_sort(c, v, a, out);
    case F_SUM: return filt_sum(c, v, a, out);
    case F_TOJSON: return filt_tojson(c, v, a, out);
    case F_TRIM: {
        BIND("trim", "chars");
        if (str_of(c, v, &sv)) return c->status;
        return do_strip(c, sv, p[0], 3, out);
    }
    case F_UNIQUE: return lazy(c, filt_unique(c, v, a, out), out);
    case F_WORDCOUNT:
        if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "wordcount takes no arguments");
        if (str_of(c, v, &sv)) return c->status;
        return filt_wordcount(c, sv, out);
    }
    return tpl_fail(c, PRISM_ENOTSUP, "unsupported filter at line %d", line);
}

/* ------------------------------------------------------------------ tests */

static int one_arg(tpl_rctx_t *c, const tpl_args_t *a, const char *name, tv_t *out)
{
    if (a->nargs + a->nkw != 1) return tpl_fail(c, PRISM_EINVAL, "test '%s' takes exactly one argument", name);
    *out = a->nargs ? a->args[0] : a->kwv[0];
    return 0;
}

static int is_lower_upper(tpl_rctx_t *c, tv_t v, bool upper, bool *res)
{
    tv_t s;
    if (tpl_to_str(c, v, &s)) return c->status;
    bool any_cased = false;
    for (size_t i = 0; i < s.u.s.n;) {
        uint32_t cp;
        i += prism_utf8_decode(s.u.s.p + i, s.u.s.n - i, &cp);
        if (upper ? cp_islower(cp) : cp_isupper(cp)) { *res = false; return 0; }
        if (cp_iscased(cp)) any_cased = true;
    }
    *res = any_cased;
    return 0;
}

int tpl_apply_test(tpl_rctx_t *c, int id, tv_t v, const tpl_args_t *a, bool *out, int line)
{
    tv_t arg, r;
    (void)line;
    bool takes_arg = id == T_DIVISIBLEBY || id == T_EQ || id == T_NE || id == T_LT || id == T_LE || id == T_GT ||
                     id == T_GE || id == T_IN || id == T_SAMEAS;
    if (!takes_arg && (a->nargs || a->nkw))
        return tpl_fail(c, PRISM_EINVAL, "test takes 1 positional argument but %d were given", 1 + a->nargs + a->nkw);
    switch (id) {
    case T_DEFINED: *out = !undef(v); return 0;
    case T_UNDEFINED: *out = undef(v); return 0;
    case T_NONE: *out = v.t == TV_NONE; return 0;
    case T_BOOLEAN: *out = v.t == TV_BOOL; return 0;
    case T_TRUE: *out = v.t == TV_BOOL && v.u.i; return 0;
    case T_FALSE: *out = v.t == TV_BOOL && !v.u.i; return 0;
    case T_INTEGER: *out = v.t == TV_INT; return 0;
    case T_FLOAT: *out = v.t == TV_FLOAT; return 0;
    case T_NUMBER: *out = tv_is_num(v); return 0;
    case T_STRING: *out = v.t == TV_STR; return 0;
    case T_MAPPING: *out = tv_is_dict(v); return 0;
    case T_CALLABLE:
        *out = undef(v) || (v.t == TV_OBJ && (v.u.o->kind == OBJ_FUNC || v.u.o->kind == OBJ_LOOP));
        return 0;
    case T_ESCAPED: *out = false; return 0;
    case T_ITERABLE:
        *out = undef(v) || v.t == TV_STR || (v.t == TV_OBJ && (v.u.o->kind == OBJ_LIST || v.u.o->kind == OBJ_DICT));
        return 0;
    case T_SEQUENCE:
        *out = undef(v) || v.t == TV_STR || tv_is_dict(v) || (tv_is_list(v) && v.u.o->sub != SEQ_ITER);
        return 0;
    case T_EVEN:
    case T_ODD:
        if (tpl_binop(c, OP_MOD, v, tv_int(2), &r)) return c->status;
        *out = tpl_eq(r, tv_int(id == T_ODD ? 1 : 0), 0);
        return 0;
    case T_DIVISIBLEBY:
        if (one_arg(c, a, "divisibleby", &arg) || tpl_binop(c, OP_MOD, v, arg, &r)) return c->status;
        *out = tpl_eq(r, tv_int(0), 0);
        return 0;
    case T_EQ:
        if (one_arg(c, a, "eq", &arg)) return c->status;
        *out = tpl_eq(v, arg, 0);
        return 0;
    case T_NE:
        if (one_arg(c, a, "ne", &arg)) return c->status;
        *out = !tpl_eq(v, arg, 0);
        return 0;
    case T_LT: case T_LE: case T_GT: case T_GE: {
        int cr;
        if (one_arg(c, a, "comparison", &arg) || tpl_cmp(c, v, arg, &cr, 0)) return c->status;
        *out = id == T_LT ? cr < 0 : id == T_LE ? cr <= 0 : id == T_GT ? cr > 0 : cr >= 0;
        return 0;
    }
    case T_IN: {
        if (one_arg(c, a, "in", &arg)) return c->status;
        if (undef(arg)) { *out = false; return 0; }
        if (arg.t == TV_STR) {
            if (v.t != TV_STR) return tpl_fail(c, PRISM_EINVAL, "'in <string>' requires string as left operand, not %s", tpl_type_name(v));
            *out = tpl_memfind(arg.u.s.p, arg.u.s.n, v.u.s.p, v.u.s.n) != NULL;
            return 0;
        }
        if (tv_is_dict(arg)) { tv_t d; *out = tpl_dict_get(arg.u.o, v, &d); return 0; }
        if (tv_is_list(arg)) {
            *out = false;
            for (size_t i = 0; i < arg.u.o->len && !*out; i++) *out = tpl_eq(v, arg.u.o->items[i], 0);
            return 0;
        }
        return tpl_fail(c, PRISM_EINVAL, "argument of type '%s' is not iterable", tpl_type_name(arg));
    }
    case T_SAMEAS:
        if (one_arg(c, a, "sameas", &arg)) return c->status;
        if (v.t != arg.t) *out = false;
        else if (v.t == TV_OBJ) *out = v.u.o == arg.u.o;
        else if (v.t == TV_STR) *out = v.u.s.p == arg.u.s.p && v.u.s.n == arg.u.s.n;
        else *out = tpl_eq(v, arg, 0);
        return 0;
    case T_LOWER: return is_lower_upper(c, v, false, out);
    case T_UPPER: return is_lower_upper(c, v, true, out);
    }
    return tpl_fail(c, PRISM_ENOTSUP, "unsupported test");
}

/* ------------------------------------------------------------------ methods */

static int str_find(tpl_rctx_t *c, tv_t s, const tpl_args_t *a, bool rev, bool raise, tv_t *out)
{
    BIND(rev ? "rfind" : "find", "sub", "start", "end");
    if (!given(p[0]) || need_str(c, p[0], "substring")) return c->status ? c->status : tpl_fail(c, PRISM_EINVAL, "find() missing argument");
    if (given(p[1]) || given(p[2])) return tpl_fail(c, PRISM_ENOTSUP, "find() start/end arguments are not supported");
    tv_t sub = p[0];
    const char *f = NULL;
    if (!rev) f = tpl_memfind(s.u.s.p, s.u.s.n, sub.u.s.p, sub.u.s.n);
    else if (sub.u.s.n <= s.u.s.n)
        for (size_t j = s.u.s.n - sub.u.s.n + 1; j > 0; j--)
            if (!memcmp(s.u.s.p + j - 1, sub.u.s.p, sub.u.s.n)) { f = s.u.s.p + j - 1; break; }
    if (!f) {
        if (raise) return tpl_fail(c, PRISM_EINVAL, "substring not found");
        *out = tv_int(-1);
        return 0;
    }
    *out = tv_int(cp_index_of(s.u.s.p, (size_t)(f - s.u.s.p)));
    return 0;
}

static int str_pred(tpl_rctx_t *c, tv_t s, int kind, tv_t *out)
{
    if (!s.u.s.n) { *out = tv_bool(false); return 0; }
    bool ok = true, any_cased = false;
    for (size_t i = 0; i < s.u.s.n && ok;) {
        uint32_t cp;
        i += prism_utf8_decode(s.u.s.p + i, s.u.s.n - i, &cp);
        switch (kind) {
        case M_ISDIGIT: ok = cp_isdigit(cp); break;
        case M_ISALPHA: ok = cp_isalpha(cp); break;
        case M_ISALNUM: ok = cp_isalnum(cp); break;
        case M_ISSPACE: ok = tpl_py_isspace(cp); break;
        case M_ISUPPER: ok = !cp_islower(cp); any_cased |= cp_iscased(cp); break;
        case M_ISLOWER: ok = !cp_isupper(cp); any_cased |= cp_iscased(cp); break;
        }
    }
    if (kind == M_ISUPPER || kind == M_ISLOWER) ok = ok && any_cased;
    *out = tv_bool(ok);
    (void)c;
    return 0;
}

static int str_join(tpl_rctx_t *c, tv_t sep, const tpl_args_t *a, tv_t *out)
{
    BIND("join", "iterable");
    if (!given(p[0])) return tpl_fail(c, PRISM_EINVAL, "join() takes exactly one argument");
    tobj_t *items;
    if (tpl_iterate(c, p[0], &items)) return c->status;
    tpl_sb_t b = {0};
    for (size_t i = 0; i < items->len; i++) {
        tv_t x = items->items[i];
        if (x.t != TV_STR)
            return tpl_fail(c, PRISM_EINVAL, "sequence item %zu: expected str instance, %s found", i, tpl_type_name(x));
        if ((i && tpl_sb_add(c, &b, sep.u.s.p, sep.u.s.n)) || tpl_sb_add(c, &b, x.u.s.p, x.u.s.n)) return c->status;
    }
    *out = tpl_sb_value(&b);
    return 0;
}

static int dict_view(tpl_rctx_t *c, tobj_t *d, int which, tv_t *out)
{
    tobj_t *r = tpl_list_new(c, SEQ_LIST, d->len);
    if (!r) return c->status;
    for (size_t i = 0; i < d->len; i++) {
        if (which == M_KEYS) r->items[i] = d->items[i];
        else if (which == M_VALUES) r->items[i] = d->vals[i];
        else {
            tobj_t *t = tpl_list_new(c, SEQ_TUPLE, 2);
            if (!t) return c->status;
            t->items[0] = d->items[i];
            t->items[1] = d->vals[i];
            t->len = 2;
            r->items[i] = tv_obj(t);
        }
    }
    r->len = d->len;
    *out = tv_obj(r);
    return 0;
}

static int no_args(tpl_rctx_t *c, const tpl_args_t *a, const char *name)
{
    if (a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "%s() takes no arguments", name);
    return 0;
}

int tpl_call_method(tpl_rctx_t *c, tv_t recv, int fid, const tpl_args_t *a, tv_t *out)
{
    if (fid >= M_UNSAFE_BASE) {
        bool is_list = fid >= M_UNSAFE_BASE + 10;
        const char *name = is_list ? list_unsafe[fid - M_UNSAFE_BASE - 10] : dict_unsafe[fid - M_UNSAFE_BASE];
        return tpl_fail(c, PRISM_EINVAL, "access to attribute '%s' of '%s' object is unsafe.", name, is_list ? "list" : "dict");
    }
    switch (fid) {
    case M_STRIP: case M_LSTRIP: case M_RSTRIP: {
        BIND("strip", "chars");
        return do_strip(c, recv, p[0], fid == M_STRIP ? 3 : fid == M_LSTRIP ? 1 : 2, out);
    }
    case M_SPLIT: case M_RSPLIT: {
        BIND("split", "sep", "maxsplit");
        return do_split(c, recv, p[0], p[1], fid == M_RSPLIT, out);
    }
    case M_SPLITLINES: {
        BIND("splitlines", "keepends");
        tobj_t *l;
        if (do_splitlines(c, recv, given(p[0]) && tpl_truthy(p[0]), &l)) return c->status;
        *out = tv_obj(l);
        return 0;
    }
    case M_STARTSWITH: case M_ENDSWITH: {
        BIND(fid == M_STARTSWITH ? "startswith" : "endswith", "prefix", "start", "end");
        if (!given(p[0])) return tpl_fail(c, PRISM_EINVAL, "startswith/endswith takes at least 1 argument");
        if (given(p[1]) || given(p[2])) return tpl_fail(c, PRISM_ENOTSUP, "startswith/endswith start/end are not supported");
        bool r;
        if (affix_test(c, recv, p[0], fid == M_ENDSWITH, &r)) return c->status;
        *out = tv_bool(r);
        return 0;
    }
    case M_UPPER: case M_LOWER: case M_TITLE: case M_CAPITALIZE:
        if (no_args(c, a, str_methods[fid])) return c->status;
        return case_map(c, recv, fid == M_UPPER ? CASE_UPPER : fid == M_LOWER ? CASE_LOWER
                                 : fid == M_TITLE ? CASE_PYTITLE : CASE_CAPITALIZE, out);
    case M_REPLACE: {
        BIND("replace", "old", "new", "count");
        if (!given(p[0]) || !given(p[1])) return tpl_fail(c, PRISM_EINVAL, "replace expected at least 2 arguments");
        if (need_str(c, p[0], "replace() argument 1") || need_str(c, p[1], "replace() argument 2")) return c->status;
        int64_t count = -1;
        if (given(p[2])) {
            if (need_int(c, p[2], "count")) return c->status;
            count = p[2].u.i;
        }
        return do_replace(c, recv, p[0], p[1], count, out);
    }
    case M_FIND: return str_find(c, recv, a, false, false, out);
    case M_RFIND: return str_find(c, recv, a, true, false, out);
    case M_INDEX_S: return str_find(c, recv, a, false, true, out);
    case M_RINDEX: return str_find(c, recv, a, true, true, out);
    case M_COUNT_S: {
        BIND("count", "sub");
        if (!given(p[0]) || need_str(c, p[0], "count() argument")) return c->status ? c->status : tpl_fail(c, PRISM_EINVAL, "count() takes at least 1 argument");
        tv_t sub = p[0];
        int64_t n = 0;
        if (!sub.u.s.n) { *out = tv_int((int64_t)prism_utf8_count(recv.u.s.p, recv.u.s.n) + 1); return 0; }
        for (size_t i = 0;;) {
            const char *f = tpl_memfind(recv.u.s.p + i, recv.u.s.n - i, sub.u.s.p, sub.u.s.n);
            if (!f) break;
            n++;
            i = (size_t)(f - recv.u.s.p) + sub.u.s.n;
        }
        *out = tv_int(n);
        return 0;
    }
    case M_JOIN: return str_join(c, recv, a, out);
    case M_ISDIGIT: case M_ISALPHA: case M_ISALNUM: case M_ISSPACE: case M_ISUPPER: case M_ISLOWER:
        if (no_args(c, a, str_methods[fid])) return c->status;
        return str_pred(c, recv, fid, out);
    case M_REMOVEPREFIX: case M_REMOVESUFFIX: {
        BIND("removeprefix", "affix");
        if (!given(p[0]) || need_str(c, p[0], "argument")) return c->status ? c->status : tpl_fail(c, PRISM_EINVAL, "missing argument");
        if (fid == M_REMOVEPREFIX && starts_with(recv, p[0])) *out = tv_str(recv.u.s.p + p[0].u.s.n, recv.u.s.n - p[0].u.s.n);
        else if (fid == M_REMOVESUFFIX && p[0].u.s.n && ends_with(recv, p[0])) *out = tv_str(recv.u.s.p, recv.u.s.n - p[0].u.s.n);
        else *out = recv;
        return 0;
    }
    case M_ITEMS: case M_KEYS: case M_VALUES:
        if (no_args(c, a, "items")) return c->status;
        return dict_view(c, recv.u.o, fid, out);
    case M_GET: {
        BIND("get", "key", "default");
        if (!given(p[0])) return tpl_fail(c, PRISM_EINVAL, "get expected at least 1 argument, got 0");
        if (!tpl_dict_get(recv.u.o, p[0], out)) *out = given(p[1]) ? p[1] : tv_none();
        return 0;
    }
    case M_COPY_D: {
        if (no_args(c, a, "copy")) return c->status;
        tobj_t *d = recv.u.o, *r = tpl_dict_new(c, OBJ_DICT, d->len);
        if (!r) return c->status;
        if (d->len) {
            memcpy(r->items, d->items, d->len * sizeof(tv_t));
            memcpy(r->vals, d->vals, d->len * sizeof(tv_t));
        }
        r->len = d->len;
        *out = tv_obj(r);
        return 0;
    }
    case M_COPY_L: {
        if (no_args(c, a, "copy")) return c->status;
        tobj_t *l = recv.u.o, *r = tpl_list_new(c, SEQ_LIST, l->len);
        if (!r) return c->status;
        if (l->len) memcpy(r->items, l->items, l->len * sizeof(tv_t));
        r->len = l->len;
        *out = tv_obj(r);
        return 0;
    }
    case M_INDEX_L: case M_COUNT_L: {
        if (a->nargs != 1 || a->nkw) return tpl_fail(c, PRISM_EINVAL, "list.%s() takes exactly one argument", fid == M_INDEX_L ? "index" : "count");
        tobj_t *l = recv.u.o;
        int64_t n = 0;
        for (size_t i = 0; i < l->len; i++)
            if (tpl_eq(l->items[i], a->args[0], 0)) {
                if (fid == M_INDEX_L) { *out = tv_int((int64_t)i); return 0; }
                n++;
            }
        if (fid == M_INDEX_L) return tpl_fail(c, PRISM_EINVAL, "value is not in list");
        *out = tv_int(n);
        return 0;
    }
    case M_CYCLE: {
        if (!a->nargs || a->nkw) return tpl_fail(c, PRISM_EINVAL, "no items for cycling given");
        *out = a->args[recv.u.o->index0 % a->nargs];
        return 0;
    }
    }
    return tpl_fail(c, PRISM_EINVAL, "unknown method");
}

/* ------------------------------------------------------------------ globals */

static int g_range(tpl_rctx_t *c, const tpl_args_t *a, tv_t *out)
{
    if (a->nkw) return tpl_fail(c, PRISM_EINVAL, "range() takes no keyword arguments");
    if (a->nargs < 1 || a->nargs > 3) return tpl_fail(c, PRISM_EINVAL, "range expected 1 to 3 arguments, got %d", a->nargs);
    for (int i = 0; i < a->nargs; i++)
        if (undef(a->args[i])) return undef_err(c, a->args[i]);
        else if (need_int(c, a->args[i], "range")) return c->status;
    int64_t start = 0, stop, step = 1;
    if (a->nargs == 1) stop = a->args[0].u.i;
    else {
        start = a->args[0].u.i;
        stop = a->args[1].u.i;
        if (a->nargs == 3) step = a->args[2].u.i;
    }
    if (step == 0) return tpl_fail(c, PRISM_EINVAL, "range() arg 3 must not be zero");
    int64_t n = 0;
    if (step > 0 && start < stop) n = (int64_t)(((uint64_t)stop - (uint64_t)start - 1) / (uint64_t)step) + 1;
    else if (step < 0 && start > stop) n = (int64_t)(((uint64_t)start - (uint64_t)stop - 1) / (uint64_t)(-(step + 1) + 1)) + 1;
    if (n > 100000)
        return tpl_fail(c, PRISM_EINVAL, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    tobj_t *r = tpl_list_new(c, SEQ_RANGE, (size_t)n);
    if (!r) return c->status;
    for (int64_t i = 0; i < n; i++) r->items[i] = tv_int(start + i * step);
    r->len = (size_t)n;
    r->r_start = start;
    r->r_stop = stop;
    r->r_step = step;
    *out = tv_obj(r);
    return 0;
}

/* dict(...) and namespace(...): positional mapping / iterable of pairs, then keyword arguments */
static int g_mapping(tpl_rctx_t *c, const tpl_args_t *a, int kind, tv_t *out)
{
    if (a->nargs > 1) return tpl_fail(c, PRISM_EINVAL, "dict expected at most 1 argument, got %d", a->nargs);
    tobj_t *d = tpl_dict_new(c, kind, 4);
    if (!d) return c->status;
    if (a->nargs == 1) {
        tv_t src = a->args[0];
        if (tv_is_dict(src) || (src.t == TV_OBJ && src.u.o->kind == OBJ_NS)) {
            for (size_t i = 0; i < src.u.o->len; i++)
                if (tpl_dict_set(c, d, src.u.o->items[i], src.u.o->vals[i])) return c->status;
        } else {
            tobj_t *items;
            if (tpl_iterate(c, src, &items)) return c->status;
            for (size_t i = 0; i < items->len; i++) {
                tobj_t *pair;
                if (tpl_iterate(c, items->items[i], &pair)) return c->status;
                if (pair->len != 2)
                    return tpl_fail(c, PRISM_EINVAL, "dictionary update sequence element #%zu has length %zu; 2 is required", i, pair->len);
                if (tpl_dict_set(c, d, pair->items[0], pair->items[1])) return c->status;
            }
        }
    }
    for (int k = 0; k < a->nkw; k++)
        if (tpl_dict_set(c, d, tv_str(a->kwn[k], strlen(a->kwn[k])), a->kwv[k])) return c->status;
    if (kind == OBJ_NS)
        for (size_t i = 0; i < d->len; i++)
            if (d->items[i].t == TV_STR && d->items[i].u.s.n && d->items[i].u.s.p[0] == '_')
                return tpl_fail(c, PRISM_EINVAL, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%.*s'.",
                                (int)PRISM_MIN(d->items[i].u.s.n, 64), d->items[i].u.s.p);
    *out = tv_obj(d);
    return 0;
}

static int g_strftime(tpl_rctx_t *c, const tpl_args_t *a, tv_t *out)
{
    BIND("strftime_now", "format");
    if (!given(p[0])) return tpl_fail(c, PRISM_EINVAL, "strftime_now() missing 1 required positional argument: 'format'");
    if (need_str(c, p[0], "strftime() argument 1")) return c->status;
    if (p[0].u.s.n > 256 || memchr(p[0].u.s.p, 0, p[0].u.s.n)) return tpl_fail(c, PRISM_EINVAL, "strftime format too long");
    char fmt[260];
    memcpy(fmt, p[0].u.s.p, p[0].u.s.n);
    fmt[p[0].u.s.n] = 0;
    struct tm tm;
    time_t t = c->fixed_time ? (time_t)c->fixed_time_s : time(NULL);
    if (c->fixed_time) gmtime_r(&t, &tm);
    else localtime_r(&t, &tm);
    char buf[1024];
    size_t n = fmt[0] ? strftime(buf, sizeof(buf), fmt, &tm) : 0;
    char *d = tpl_alloc(c, n + 1);
    if (!d) return c->status;
    memcpy(d, buf, n);
    d[n] = 0;
    *out = tv_str(d, n);
    return 0;
}

int tpl_call_global(tpl_rctx_t *c, int fid, const tpl_args_t *a, tv_t *out)
{
    switch (fid) {
    case G_RANGE: return g_range(c, a, out);
    case G_NAMESPACE: return g_mapping(c, a, OBJ_NS, out);
    case G_DICT: return g_mapping(c, a, OBJ_DICT, out);
    case G_RAISE: {
        tv_t msg = a->nargs ? a->args[0] : a->nkw ? a->kwv[0] : tv_str("", 0);
        tv_t s;
        if (tpl_to_str(c, msg, &s)) return c->status;
        return tpl_fail(c, PRISM_EINVAL, "%.*s", (int)PRISM_MIN(s.u.s.n, 4096), s.u.s.p);
    }
    case G_STRFTIME: return g_strftime(c, a, out);
    }
    return tpl_fail(c, PRISM_EINVAL, "unknown global");
}
