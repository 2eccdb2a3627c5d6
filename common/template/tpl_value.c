/* Values with Python semantics: str()/repr() formatting, truthiness, equality and ordering,
 * iteration, len(), and json.dumps as HF's tojson filter calls it. */
#include "template/tpl_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int tpl_fail(tpl_rctx_t *c, int status, const char *fmt, ...)
{
    if (c->status) return c->status;
    c->status = status;
    if (c->err && c->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, c->errlen, fmt, ap);
        va_end(ap);
    }
    return status;
}

void *tpl_alloc(tpl_rctx_t *c, size_t n)
{
    void *p = tpl_pool_alloc(&c->pool, n);
    if (!p) tpl_fail(c, PRISM_ELIMIT, "template render exceeded its memory limit (%u MiB)",
                     (unsigned)(PRISM_TEMPLATE_MAX_MEMORY >> 20));
    return p;
}

/* ------------------------------------------------------------------ string builder */

int tpl_sb_reserve(tpl_rctx_t *c, tpl_sb_t *b, size_t extra)
{
    if (c->status) return c->status;
    if (extra > PRISM_TEMPLATE_MAX_OUTPUT || b->n + extra > PRISM_TEMPLATE_MAX_OUTPUT)
        return tpl_fail(c, PRISM_ELIMIT, "rendered text exceeds %u MiB", (unsigned)(PRISM_TEMPLATE_MAX_OUTPUT >> 20));
    if (b->n + extra <= b->cap) return 0;
    size_t ncap = b->cap ? b->cap * 2 : 64;
    while (ncap < b->n + extra) ncap *= 2;
    char *np = tpl_alloc(c, ncap);
    if (!np) return c->status;
    if (b->n) memcpy(np, b->p, b->n);
    b->p = np;
    b->cap = ncap;
    return 0;
}

int tpl_sb_add(tpl_rctx_t *c, tpl_sb_t *b, const char *p, size_t n)
{
    if (!n) return c->status;
    if (tpl_sb_reserve(c, b, n)) return c->status;
    memcpy(b->p + b->n, p, n);
    b->n += n;
    return 0;
}

int tpl_sb_addc(tpl_rctx_t *c, tpl_sb_t *b, char ch) { return tpl_sb_add(c, b, &ch, 1); }

int tpl_sb_addf(tpl_rctx_t *c, tpl_sb_t *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0) return tpl_fail(c, PRISM_EINVAL, "format error");
    return tpl_sb_add(c, b, tmp, (size_t)n < sizeof(tmp) ? (size_t)n : sizeof(tmp) - 1);
}

tv_t tpl_sb_value(tpl_sb_t *b) { return tv_str(b->p ? b->p : "", b->n); }

/* ------------------------------------------------------------------ containers */

tobj_t *tpl_list_new(tpl_rctx_t *c, int sub, size_t cap)
{
    tobj_t *o = tpl_alloc(c, sizeof(*o));
    if (!o) return NULL;
    memset(o, 0, sizeof(*o));
    o->kind = OBJ_LIST;
    o->sub = (uint8_t)sub;
    if (cap) {
        o->items = tpl_alloc(c, cap * sizeof(tv_t));
        if (!o->items) return NULL;
        o->cap = cap;
    }
    return o;
}

static int grow(tpl_rctx_t *c, tobj_t *o, bool vals)
{
    size_t ncap = o->cap ? o->cap * 2 : 4;
    if (ncap > (PRISM_TEMPLATE_MAX_MEMORY / sizeof(tv_t)))
        return tpl_fail(c, PRISM_ELIMIT, "container too large");
    tv_t *ni = tpl_alloc(c, ncap * sizeof(tv_t));
    if (!ni) return c->status;
    if (o->len) memcpy(ni, o->items, o->len * sizeof(tv_t));
    o->items = ni;
    if (vals) {
        tv_t *nv = tpl_alloc(c, ncap * sizeof(tv_t));
        if (!nv) return c->status;
        if (o->len) memcpy(nv, o->vals, o->len * sizeof(tv_t));
        o->vals = nv;
    }
    o->cap = ncap;
    return 0;
}

int tpl_list_push(tpl_rctx_t *c, tobj_t *l, tv_t v)
{
    if (l->len == l->cap && grow(c, l, false)) return c->status;
    l->items[l->len++] = v;
    return 0;
}

tobj_t *tpl_dict_new(tpl_rctx_t *c, int kind, size_t cap)
{
    tobj_t *o = tpl_alloc(c, sizeof(*o));
    if (!o) return NULL;
    memset(o, 0, sizeof(*o));
    o->kind = (uint8_t)kind;
    if (cap) {
        o->items = tpl_alloc(c, cap * sizeof(tv_t));
        o->vals = tpl_alloc(c, cap * sizeof(tv_t));
        if (!o->items || !o->vals) return NULL;
        o->cap = cap;
    }
    return o;
}

static bool key_eq(tv_t a, tv_t b)
{
    if (a.t == TV_STR && b.t == TV_STR) return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    return tpl_eq(a, b, 0);
}

int tpl_dict_set(tpl_rctx_t *c, tobj_t *d, tv_t k, tv_t v)
{
    for (size_t i = 0; i < d->len; i++)
        if (key_eq(d->items[i], k)) { d->vals[i] = v; return 0; }
    if (d->len == d->cap && grow(c, d, true)) return c->status;
    d->items[d->len] = k;
    d->vals[d->len] = v;
    d->len++;
    return 0;
}

bool tpl_dict_get(const tobj_t *d, tv_t k, tv_t *out)
{
    for (size_t i = 0; i < d->len; i++)
        if (key_eq(d->items[i], k)) { *out = d->vals[i]; return true; }
    return false;
}

bool tpl_dict_get_str(const tobj_t *d, const char *k, size_t kn, tv_t *out)
{
    for (size_t i = 0; i < d->len; i++) {
        tv_t key = d->items[i];
        if (key.t == TV_STR && key.u.s.n == kn && !memcmp(key.u.s.p, k, kn)) { *out = d->vals[i]; return true; }
    }
    return false;
}

tobj_t *tpl_func_new(tpl_rctx_t *c, int sub, int fid)
{
    tobj_t *o = tpl_alloc(c, sizeof(*o));
    if (!o) return NULL;
    memset(o, 0, sizeof(*o));
    o->kind = OBJ_FUNC;
    o->sub = (uint8_t)sub;
    o->fid = fid;
    return o;
}

/* ------------------------------------------------------------------ json in */

int tpl_from_json(tpl_rctx_t *c, const json_t *j, tv_t *out, int depth)
{
    if (depth > PRISM_TEMPLATE_MAX_VALUE_DEPTH)
        return tpl_fail(c, PRISM_ELIMIT, "context nested deeper than %d", PRISM_TEMPLATE_MAX_VALUE_DEPTH);
    switch (json_typeof(j)) {
    case JSON_NULL: *out = tv_none(); return 0;
    case JSON_TRUE: *out = tv_bool(true); return 0;
    case JSON_FALSE: *out = tv_bool(false); return 0;
    case JSON_INTEGER: *out = tv_int((int64_t)json_integer_value(j)); return 0;
    case JSON_REAL: *out = tv_float(json_real_value(j)); return 0;
    case JSON_STRING: *out = tv_str(json_string_value(j), json_string_length(j)); return 0;
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        tobj_t *l = tpl_list_new(c, SEQ_LIST, n);
        if (!l) return c->status;
        for (size_t i = 0; i < n; i++) {
            if (tpl_from_json(c, json_array_get(j, i), &l->items[i], depth + 1)) return c->status;
        }
        l->len = n;
        *out = tv_obj(l);
        return 0;
    }
    case JSON_OBJECT: {
        size_t n = json_object_size(j);
        tobj_t *d = tpl_dict_new(c, OBJ_DICT, n);
        if (!d) return c->status;
        const char *key;
        json_t *val;
        void *it = json_object_iter((json_t *)j);
        size_t i = 0;
        while (it && i < n) {
            key = json_object_iter_key(it);
            val = json_object_iter_value(it);
            d->items[i] = tv_str(key, json_object_iter_key_len(it));
            if (tpl_from_json(c, val, &d->vals[i], depth + 1)) return c->status;
            i++;
            it = json_object_iter_next((json_t *)j, it);
        }
        d->len = i;
        *out = tv_obj(d);
        return 0;
    }
    }
    return tpl_fail(c, PRISM_EINVAL, "unsupported JSON value in context");
}

/* ------------------------------------------------------------------ truthiness, names */

bool tpl_truthy(tv_t v)
{
    switch (v.t) {
    case TV_MISSING: case TV_UNDEF: case TV_NONE: return false;
    case TV_BOOL: case TV_INT: return v.u.i != 0;
    case TV_FLOAT: return v.u.f != 0.0;
    case TV_STR: return v.u.s.n > 0;
    case TV_OBJ:
        switch (v.u.o->kind) {
        case OBJ_LIST: return v.u.o->sub == SEQ_ITER ? true : v.u.o->len > 0;
        case OBJ_DICT: return v.u.o->len > 0;
        default: return true;
        }
    }
    return false;
}

const char *tpl_type_name(tv_t v)
{
    switch (v.t) {
    case TV_MISSING: case TV_UNDEF: return "Undefined";
    case TV_NONE: return "NoneType";
    case TV_BOOL: return "bool";
    case TV_INT: return "int";
    case TV_FLOAT: return "float";
    case TV_STR: return "str";
    case TV_OBJ:
        switch (v.u.o->kind) {
        case OBJ_LIST:
            switch (v.u.o->sub) {
            case SEQ_TUPLE: return "tuple";
            case SEQ_ITER: return "generator";
            case SEQ_RANGE: return "range";
            default: return "list";
            }
        case OBJ_DICT: return "dict";
        case OBJ_NS: return "Namespace";
        case OBJ_FUNC: return v.u.o->sub == FN_MACRO || v.u.o->sub == FN_CALLER ? "Macro" : "builtin_function_or_method";
        case OBJ_LOOP: return "LoopContext";
        }
    }
    return "object";
}

/* ------------------------------------------------------------------ str / repr */

void tpl_float_repr(double f, char out[40])
{
    if (isnan(f)) { strcpy(out, "nan"); return; }
    if (isinf(f)) { strcpy(out, f < 0 ? "-inf" : "inf"); return; }
    if (f == 0) { strcpy(out, signbit(f) ? "-0.0" : "0.0"); return; }
    char buf[48];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof(buf), "%.*e", prec - 1, f);
        if (strtod(buf, NULL) == f) break;
    }
    /* buf: [-]d[.ddd]e[+-]XX */
    char digits[24];
    int nd = 0;
    const char *p = buf;
    bool neg = false;
    if (*p == '-') { neg = true; p++; }
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9' && nd < 20) digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char *o = out;
    if (neg) *o++ = '-';
    if (exp >= -4 && exp < 16) {
        if (exp >= 0) {
            for (int i = 0; i <= exp; i++) *o++ = i < nd ? digits[i] : '0';
            *o++ = '.';
            if (nd > exp + 1)
                for (int i = exp + 1; i < nd; i++) *o++ = digits[i];
            else
                *o++ = '0';
        } else {
            *o++ = '0';
            *o++ = '.';
            for (int i = 0; i < -exp - 1; i++) *o++ = '0';
            for (int i = 0; i < nd; i++) *o++ = digits[i];
        }
        *o = 0;
    } else {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            for (int i = 1; i < nd; i++) *o++ = digits[i];
        }
        snprintf(o, (size_t)(out + 40 - o), "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
}

static bool py_printable(uint32_t c)
{
    if (c < 0x20 || c == 0x7f) return false;
    if (c < 0x7f) return true;
    if (c <= 0xA0 || c == 0xAD) return false;
    if (c == 0x1680 || c == 0x180E || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
        (c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF || (c >= 0xD800 && c <= 0xF8FF) ||
        (c >= 0xFFF0 && c <= 0xFFFB) || c == 0xFFFE || c == 0xFFFF || c >= 0xF0000 || (c >= 0xE0000 && c <= 0xE0FFF))
        return false;
    return true;
}

static int write_str_repr(tpl_rctx_t *c, tpl_sb_t *b, const char *s, size_t n)
{
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    if (tpl_sb_addc(c, b, q)) return c->status;
    size_t i = 0;
    while (i < n) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x80) {
            i++;
            if (ch == (unsigned char)q || ch == '\\') { char e[2] = {'\\', (char)ch}; tpl_sb_add(c, b, e, 2); }
            else if (ch == '\t') tpl_sb_add(c, b, "\\t", 2);
            else if (ch == '\n') tpl_sb_add(c, b, "\\n", 2);
            else if (ch == '\r') tpl_sb_add(c, b, "\\r", 2);
            else if (ch < 0x20 || ch == 0x7f) tpl_sb_addf(c, b, "\\x%02x", ch);
            else tpl_sb_addc(c, b, (char)ch);
            continue;
        }
        uint32_t cp;
        size_t k = prism_utf8_decode(s + i, n - i, &cp);
        if (py_printable(cp)) tpl_sb_add(c, b, s + i, k);
        else if (cp <= 0xFF) tpl_sb_addf(c, b, "\\x%02x", cp);
        else if (cp <= 0xFFFF) tpl_sb_addf(c, b, "\\u%04x", cp);
        else tpl_sb_addf(c, b, "\\U%08x", cp);
        i += k;
    }
    tpl_sb_addc(c, b, q);
    return c->status;
}

static int write_scalar(tpl_rctx_t *c, tpl_sb_t *b, tv_t v)
{
    char tmp[40];
    switch (v.t) {
    case TV_NONE: return tpl_sb_add(c, b, "None", 4);
    case TV_BOOL: return v.u.i ? tpl_sb_add(c, b, "True", 4) : tpl_sb_add(c, b, "False", 5);
    case TV_INT: return tpl_sb_addf(c, b, "%lld", (long long)v.u.i);
    case TV_FLOAT: tpl_float_repr(v.u.f, tmp); return tpl_sb_add(c, b, tmp, strlen(tmp));
    default: return 0;
    }
}

int tpl_write_repr(tpl_rctx_t *c, tpl_sb_t *b, tv_t v, int depth)
{
    if (depth > PRISM_TEMPLATE_MAX_VALUE_DEPTH) return tpl_fail(c, PRISM_ELIMIT, "value nested too deeply");
    switch (v.t) {
    case TV_MISSING: case TV_UNDEF: return tpl_sb_add(c, b, "Undefined", 9);
    case TV_STR: return write_str_repr(c, b, v.u.s.p, v.u.s.n);
    case TV_OBJ: break;
    default: return write_scalar(c, b, v);
    }
    tobj_t *o = v.u.o;
    switch (o->kind) {
    case OBJ_LIST:
        if (o->sub == SEQ_ITER) return tpl_sb_add(c, b, "<generator object>", 18);
        if (o->sub == SEQ_RANGE) {
            if (o->r_step == 1) return tpl_sb_addf(c, b, "range(%lld, %lld)", (long long)o->r_start, (long long)o->r_stop);
            return tpl_sb_addf(c, b, "range(%lld, %lld, %lld)", (long long)o->r_start, (long long)o->r_stop, (long long)o->r_step);
        }
        tpl_sb_addc(c, b, o->sub == SEQ_TUPLE ? '(' : '[');
        for (size_t i = 0; i < o->len; i++) {
            if (i) tpl_sb_add(c, b, ", ", 2);
            if (tpl_write_repr(c, b, o->items[i], depth + 1)) return c->status;
        }
        if (o->sub == SEQ_TUPLE && o->len == 1) tpl_sb_addc(c, b, ',');
        return tpl_sb_addc(c, b, o->sub == SEQ_TUPLE ? ')' : ']');
    case OBJ_DICT:
    case OBJ_NS:
        if (o->kind == OBJ_NS) tpl_sb_add(c, b, "<Namespace ", 11);
        tpl_sb_addc(c, b, '{');
        for (size_t i = 0; i < o->len; i++) {
            if (i) tpl_sb_add(c, b, ", ", 2);
            if (tpl_write_repr(c, b, o->items[i], depth + 1)) return c->status;
            tpl_sb_add(c, b, ": ", 2);
            if (tpl_write_repr(c, b, o->vals[i], depth + 1)) return c->status;
        }
        tpl_sb_addc(c, b, '}');
        if (o->kind == OBJ_NS) tpl_sb_addc(c, b, '>');
        return c->status;
    case OBJ_FUNC:
        if (o->sub == FN_MACRO || o->sub == FN_CALLER)
            return tpl_sb_addf(c, b, "<Macro '%s'>", o->sub == FN_CALLER ? "caller" : o->macro->name);
        return tpl_sb_addf(c, b, "<built-in method %s>", tpl_func_name(o));
    case OBJ_LOOP:
        return tpl_sb_addf(c, b, "<LoopContext %lld/%lld>", (long long)(o->index0 + 1), (long long)o->length);
    }
    return 0;
}

int tpl_write_str(tpl_rctx_t *c, tpl_sb_t *b, tv_t v)
{
    switch (v.t) {
    case TV_MISSING: case TV_UNDEF: return c->status;
    case TV_STR: return tpl_sb_add(c, b, v.u.s.p, v.u.s.n);
    case TV_OBJ: return tpl_write_repr(c, b, v, 0);
    default: return write_scalar(c, b, v);
    }
}

int tpl_to_str(tpl_rctx_t *c, tv_t v, tv_t *out)
{
    if (v.t == TV_STR) { *out = v; return 0; }
    if (v.t == TV_UNDEF || v.t == TV_MISSING) { *out = tv_str("", 0); return 0; }
    tpl_sb_t b = {0};
    if (tpl_write_str(c, &b, v)) return c->status;
    *out = tpl_sb_value(&b);
    return 0;
}

/* ------------------------------------------------------------------ equality / ordering */

static double num_f(tv_t v) { return v.t == TV_FLOAT ? v.u.f : (double)v.u.i; }

bool tpl_eq(tv_t a, tv_t b, int depth)
{
    if (depth > PRISM_TEMPLATE_MAX_VALUE_DEPTH) return false;
    if (tv_is_num(a) && tv_is_num(b)) {
        if (a.t != TV_FLOAT && b.t != TV_FLOAT) return a.u.i == b.u.i;
        return num_f(a) == num_f(b);
    }
    bool au = a.t == TV_UNDEF || a.t == TV_MISSING, bu = b.t == TV_UNDEF || b.t == TV_MISSING;
    if (au || bu) return au && bu;
    if (a.t != b.t) return false;
    switch (a.t) {
    case TV_NONE: return true;
    case TV_STR: return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    case TV_OBJ: break;
    default: return false;
    }
    tobj_t *x = a.u.o, *y = b.u.o;
    if (x == y) return true;
    if (x->kind != y->kind) return false;
    if (x->kind == OBJ_LIST) {
        if (x->sub != y->sub || x->sub == SEQ_ITER) return false;
        if (x->len != y->len) return false;
        for (size_t i = 0; i < x->len; i++)
            if (!tpl_eq(x->items[i], y->items[i], depth + 1)) return false;
        return true;
    }
    if (x->kind == OBJ_DICT) {
        if (x->len != y->len) return false;
        for (size_t i = 0; i < x->len; i++) {
            tv_t yv;
            if (!tpl_dict_get(y, x->items[i], &yv)) return false;
            if (!tpl_eq(x->vals[i], yv, depth + 1)) return false;
        }
        return true;
    }
    return false;
}

int tpl_cmp(tpl_rctx_t *c, tv_t a, tv_t b, int *res, int depth)
{
    if (depth > PRISM_TEMPLATE_MAX_VALUE_DEPTH) return tpl_fail(c, PRISM_ELIMIT, "value nested too deeply");
    if (a.t == TV_UNDEF || a.t == TV_MISSING)
        return tpl_fail(c, PRISM_EINVAL, "'%s' is undefined", a.u.uname ? a.u.uname : "value");
    if (b.t == TV_UNDEF || b.t == TV_MISSING)
        return tpl_fail(c, PRISM_EINVAL, "'%s' is undefined", b.u.uname ? b.u.uname : "value");
    if (tv_is_num(a) && tv_is_num(b)) {
        if (a.t != TV_FLOAT && b.t != TV_FLOAT) *res = (a.u.i > b.u.i) - (a.u.i < b.u.i);
        else {
            double x = num_f(a), y = num_f(b);
            *res = (x > y) - (x < y); /* NaN compares as equal-ish; Python yields False for all, rare */
        }
        return 0;
    }
    if (a.t == TV_STR && b.t == TV_STR) {
        size_t m = PRISM_MIN(a.u.s.n, b.u.s.n);
        int r = m ? memcmp(a.u.s.p, b.u.s.p, m) : 0;
        if (!r) r = (a.u.s.n > b.u.s.n) - (a.u.s.n < b.u.s.n);
        *res = (r > 0) - (r < 0);
        return 0;
    }
    if (tv_is_list(a) && tv_is_list(b) && a.u.o->sub == b.u.o->sub &&
        (a.u.o->sub == SEQ_LIST || a.u.o->sub == SEQ_TUPLE)) {
        tobj_t *x = a.u.o, *y = b.u.o;
        for (size_t i = 0; i < x->len && i < y->len; i++) {
            if (tpl_eq(x->items[i], y->items[i], depth + 1)) continue;
            return tpl_cmp(c, x->items[i], y->items[i], res, depth + 1);
        }
        *res = (x->len > y->len) - (x->len < y->len);
        return 0;
    }
    return tpl_fail(c, PRISM_EINVAL, "'<' not supported between instances of '%s' and '%s'", tpl_type_name(a),
                    tpl_type_name(b));
}

/* ------------------------------------------------------------------ iteration */

int tpl_iterate(tpl_rctx_t *c, tv_t v, tobj_t **out)
{
    switch (v.t) {
    case TV_UNDEF: case TV_MISSING:
        *out = tpl_list_new(c, SEQ_LIST, 0);
        return *out ? 0 : c->status;
    case TV_STR: {
        const char *s = v.u.s.p;
        size_t n = v.u.s.n;
        tobj_t *l = tpl_list_new(c, SEQ_LIST, prism_utf8_count(s, n));
        if (!l) return c->status;
        for (size_t i = 0; i < n;) {
            uint32_t cp;
            size_t k = prism_utf8_decode(s + i, n - i, &cp);
            l->items[l->len++] = tv_str(s + i, k);
            i += k;
        }
        *out = l;
        return 0;
    }
    case TV_OBJ: break;
    default:
        return tpl_fail(c, PRISM_EINVAL, "'%s' object is not iterable", tpl_type_name(v));
    }
    tobj_t *o = v.u.o;
    if (o->kind == OBJ_LIST) {
        if (o->sub == SEQ_ITER) {
            if (o->poison) return tpl_fail(c, PRISM_EINVAL, "%s", o->poison);
            tobj_t *l = tpl_list_new(c, SEQ_LIST, 0);
            if (!l) return c->status;
            l->items = o->items ? o->items + o->pos : NULL;  /* NULL + 0 is undefined in C */
            l->len = l->cap = o->len - o->pos;
            o->pos = o->len;
            *out = l;
            return 0;
        }
        *out = o;
        return 0;
    }
    if (o->kind == OBJ_DICT) {
        tobj_t *l = tpl_list_new(c, SEQ_LIST, o->len);
        if (!l) return c->status;
        if (o->len) memcpy(l->items, o->items, o->len * sizeof(tv_t));
        l->len = o->len;
        *out = l;
        return 0;
    }
    return tpl_fail(c, PRISM_EINVAL, "'%s' object is not iterable", tpl_type_name(v));
}

int tpl_len(tpl_rctx_t *c, tv_t v, int64_t *out)
{
    switch (v.t) {
    case TV_UNDEF: case TV_MISSING: *out = 0; return 0;
    case TV_STR: *out = (int64_t)prism_utf8_count(v.u.s.p, v.u.s.n); return 0;
    case TV_OBJ:
        if ((v.u.o->kind == OBJ_LIST && v.u.o->sub != SEQ_ITER) || v.u.o->kind == OBJ_DICT) {
            *out = (int64_t)v.u.o->len;
            return 0;
        }
        break;
    default: break;
    }
    return tpl_fail(c, PRISM_EINVAL, "object of type '%s' has no len()", tpl_type_name(v));
}

/* ------------------------------------------------------------------ json out (json.dumps) */

static int json_str(tpl_rctx_t *c, tpl_sb_t *b, const char *s, size_t n, bool ensure_ascii)
{
    if (tpl_sb_addc(c, b, '"')) return c->status;
    size_t i = 0;
    while (i < n) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x80) {
            i++;
            switch (ch) {
            case '"': tpl_sb_add(c, b, "\\\"", 2); break;
            case '\\': tpl_sb_add(c, b, "\\\\", 2); break;
            case '\n': tpl_sb_add(c, b, "\\n", 2); break;
            case '\r': tpl_sb_add(c, b, "\\r", 2); break;
            case '\t': tpl_sb_add(c, b, "\\t", 2); break;
            case '\b': tpl_sb_add(c, b, "\\b", 2); break;
            case '\f': tpl_sb_add(c, b, "\\f", 2); break;
            default:
                if (ch < 0x20 || (ensure_ascii && ch == 0x7f)) tpl_sb_addf(c, b, "\\u%04x", ch);
                else tpl_sb_addc(c, b, (char)ch);
            }
            continue;
        }
        uint32_t cp;
        size_t k = prism_utf8_decode(s + i, n - i, &cp);
        if (!ensure_ascii) {
            tpl_sb_add(c, b, s + i, k);
        } else if (cp > 0xFFFF) {
            uint32_t v = cp - 0x10000;
            tpl_sb_addf(c, b, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
        } else {
            tpl_sb_addf(c, b, "\\u%04x", cp);
        }
        i += k;
    }
    return tpl_sb_addc(c, b, '"');
}

static int json_newline(tpl_rctx_t *c, tpl_sb_t *b, const tpl_json_opts_t *o, int level)
{
    if (tpl_sb_addc(c, b, '\n')) return c->status;
    tv_t ind = o->indent;
    for (int i = 0; i < level; i++) {
        if (ind.t == TV_STR) tpl_sb_add(c, b, ind.u.s.p, ind.u.s.n);
        else for (int64_t k = 0; k < ind.u.i; k++) tpl_sb_addc(c, b, ' ');
        if (c->status) return c->status;
    }
    return 0;
}

static int json_key(tpl_rctx_t *c, tpl_sb_t *b, tv_t k, const tpl_json_opts_t *o)
{
    char tmp[40];
    switch (k.t) {
    case TV_STR: return json_str(c, b, k.u.s.p, k.u.s.n, o->ensure_ascii);
    case TV_BOOL: return json_str(c, b, k.u.i ? "true" : "false", k.u.i ? 4 : 5, false);
    case TV_NONE: return json_str(c, b, "null", 4, false);
    case TV_INT: snprintf(tmp, sizeof(tmp), "%lld", (long long)k.u.i); return json_str(c, b, tmp, strlen(tmp), false);
    case TV_FLOAT:
        if (isnan(k.u.f)) strcpy(tmp, "NaN");
        else if (isinf(k.u.f)) strcpy(tmp, k.u.f < 0 ? "-Infinity" : "Infinity");
        else tpl_float_repr(k.u.f, tmp);
        return json_str(c, b, tmp, strlen(tmp), false);
    default:
        return tpl_fail(c, PRISM_EINVAL, "keys must be str, int, float, bool or None, not %s", tpl_type_name(k));
    }
}

int tpl_write_json(tpl_rctx_t *c, tpl_sb_t *b, tv_t v, const tpl_json_opts_t *o, int level, int depth)
{
    if (depth > PRISM_TEMPLATE_MAX_VALUE_DEPTH) return tpl_fail(c, PRISM_ELIMIT, "value nested too deeply");
    char tmp[40];
    switch (v.t) {
    case TV_NONE: return tpl_sb_add(c, b, "null", 4);
    case TV_BOOL: return v.u.i ? tpl_sb_add(c, b, "true", 4) : tpl_sb_add(c, b, "false", 5);
    case TV_INT: return tpl_sb_addf(c, b, "%lld", (long long)v.u.i);
    case TV_FLOAT:
        if (isnan(v.u.f)) return tpl_sb_add(c, b, "NaN", 3);
        if (isinf(v.u.f)) return v.u.f < 0 ? tpl_sb_add(c, b, "-Infinity", 9) : tpl_sb_add(c, b, "Infinity", 8);
        tpl_float_repr(v.u.f, tmp);
        return tpl_sb_add(c, b, tmp, strlen(tmp));
    case TV_STR: return json_str(c, b, v.u.s.p, v.u.s.n, o->ensure_ascii);
    case TV_OBJ: break;
    default:
        return tpl_fail(c, PRISM_EINVAL, "Object of type Undefined is not JSON serializable");
    }
    tobj_t *x = v.u.o;
    if (x->kind == OBJ_LIST && (x->sub == SEQ_LIST || x->sub == SEQ_TUPLE)) {
        if (!x->len) return tpl_sb_add(c, b, "[]", 2);
        tpl_sb_addc(c, b, '[');
        for (size_t i = 0; i < x->len; i++) {
            if (i) tpl_sb_add(c, b, o->item_sep, o->item_sep_n);
            if (o->has_indent && json_newline(c, b, o, level + 1)) return c->status;
            if (tpl_write_json(c, b, x->items[i], o, level + 1, depth + 1)) return c->status;
        }
        if (o->has_indent && json_newline(c, b, o, level)) return c->status;
        return tpl_sb_addc(c, b, ']');
    }
    if (x->kind == OBJ_DICT) {
        if (!x->len) return tpl_sb_add(c, b, "{}", 2);
        size_t *order = tpl_alloc(c, x->len * sizeof(size_t));
        if (!order) return c->status;
        for (size_t i = 0; i < x->len; i++) order[i] = i;
        if (o->sort_keys) {
            /* insertion sort keeps it stable and dependency-free; dicts here are small */
            for (size_t i = 1; i < x->len; i++) {
                size_t k = order[i], j = i;
                while (j > 0) {
                    int r;
                    if (tpl_cmp(c, x->items[order[j - 1]], x->items[k], &r, depth + 1)) return c->status;
                    if (r <= 0) break;
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = k;
            }
        }
        tpl_sb_addc(c, b, '{');
        for (size_t i = 0; i < x->len; i++) {
            size_t k = order[i];
            if (i) tpl_sb_add(c, b, o->item_sep, o->item_sep_n);
            if (o->has_indent && json_newline(c, b, o, level + 1)) return c->status;
            if (json_key(c, b, x->items[k], o)) return c->status;
            tpl_sb_add(c, b, o->key_sep, o->key_sep_n);
            if (tpl_write_json(c, b, x->vals[k], o, level + 1, depth + 1)) return c->status;
        }
        if (o->has_indent && json_newline(c, b, o, level)) return c->status;
        return tpl_sb_addc(c, b, '}');
    }
    return tpl_fail(c, PRISM_EINVAL, "Object of type %s is not JSON serializable", tpl_type_name(v));
}
