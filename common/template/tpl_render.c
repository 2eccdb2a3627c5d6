/* Renderer: evaluates the AST with jinja2's runtime semantics (default Undefined, scoping where each
 * loop iteration and macro call gets a fresh frame, immutable sandbox) into the render pool. */
#include "template/tpl_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ scopes */

static tpl_scope_t *scope_new(tpl_rctx_t *c, tpl_scope_t *parent)
{
    tpl_scope_t *s = tpl_alloc(c, sizeof(*s));
    if (!s) return NULL;
    memset(s, 0, sizeof(*s));
    s->parent = parent;
    return s;
}

static int scope_set(tpl_rctx_t *c, tpl_scope_t *s, const char *name, tv_t v)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) { s->vals[i] = v; return 0; }
    if (s->n == s->cap) {
        int ncap = s->cap ? s->cap * 2 : 8;
        const char **nn = tpl_alloc(c, (size_t)ncap * sizeof(*nn));
        tv_t *nv = tpl_alloc(c, (size_t)ncap * sizeof(*nv));
        if (!nn || !nv) return c->status;
        if (s->n) {
            memcpy(nn, s->names, (size_t)s->n * sizeof(*nn));
            memcpy(nv, s->vals, (size_t)s->n * sizeof(*nv));
        }
        s->names = nn;
        s->vals = nv;
        s->cap = ncap;
    }
    s->names[s->n] = name;
    s->vals[s->n] = v;
    s->n++;
    return 0;
}

static bool scope_get(const tpl_scope_t *s, const char *name, tv_t *out)
{
    for (; s; s = s->parent)
        for (int i = s->n - 1; i >= 0; i--)
            if (!strcmp(s->names[i], name)) { *out = s->vals[i]; return true; }
    return false;
}

static int undefined_error(tpl_rctx_t *c, tv_t v)
{
    return tpl_fail(c, PRISM_EINVAL, "'%s' is undefined", v.u.uname ? v.u.uname : "value");
}

static bool is_undef(tv_t v) { return v.t == TV_UNDEF || v.t == TV_MISSING; }

/* ------------------------------------------------------------------ attribute / item access */

/* An undefined value keeps its name for error messages; the name must outlive the lookup (callers
 * pass stack buffers and unterminated slices), so it is copied into the render pool. */
static tv_t undef_named(tpl_rctx_t *c, const char *name, size_t n)
{
    char *d = tpl_pool_strndup(&c->pool, name, n);
    return tv_undef(d ? d : "value");
}

static int loop_attr(tpl_rctx_t *c, tobj_t *l, const char *name, tv_t *out)
{
    int64_t i = l->index0, n = l->length;
    if (!strcmp(name, "index")) *out = tv_int(i + 1);
    else if (!strcmp(name, "index0")) *out = tv_int(i);
    else if (!strcmp(name, "revindex")) *out = tv_int(n - i);
    else if (!strcmp(name, "revindex0")) *out = tv_int(n - i - 1);
    else if (!strcmp(name, "first")) *out = tv_bool(i == 0);
    else if (!strcmp(name, "last")) *out = tv_bool(i == n - 1);
    else if (!strcmp(name, "length")) *out = tv_int(n);
    else if (!strcmp(name, "depth")) *out = tv_int(l->depth);
    else if (!strcmp(name, "depth0")) *out = tv_int(l->depth - 1);
    else if (!strcmp(name, "previtem")) *out = i > 0 ? l->loop_items->items[i - 1] : tv_undef("previtem");
    else if (!strcmp(name, "nextitem")) *out = i + 1 < n ? l->loop_items->items[i + 1] : tv_undef("nextitem");
    else *out = undef_named(c, name, strlen(name));
    return 0;
}

int tpl_getattr(tpl_rctx_t *c, tv_t obj, const char *name, size_t nlen, tv_t *out)
{
    if (is_undef(obj)) return undefined_error(c, obj);
    int fid = tpl_method_lookup(obj, name, nlen);
    if (fid >= 0) {
        tobj_t *f = tpl_func_new(c, FN_METHOD, fid);
        if (!f) return c->status;
        f->recv = obj;
        *out = tv_obj(f);
        return 0;
    }
    if (obj.t == TV_OBJ) {
        tobj_t *o = obj.u.o;
        if (o->kind == OBJ_DICT || o->kind == OBJ_NS) {
            if (tpl_dict_get_str(o, name, nlen, out)) return 0;
        } else if (o->kind == OBJ_LOOP && nlen < 32) {
            char nm[32];
            memcpy(nm, name, nlen);
            nm[nlen] = 0;
            return loop_attr(c, o, nm, out);
        }
    }
    *out = undef_named(c, name, nlen);
    return 0;
}

/* Python slice.indices() for a sequence of length len. */
static int64_t slice_indices(int64_t len, tv_t st, tv_t sp, int64_t step, int64_t *start, int64_t *stop)
{
    int64_t a, b;
    if (st.t == TV_NONE) a = step < 0 ? len - 1 : 0;
    else {
        a = st.u.i;
        if (a < 0) { a += len; if (a < 0) a = step < 0 ? -1 : 0; }
        else if (a >= len) a = step < 0 ? len - 1 : len;
    }
    if (sp.t == TV_NONE) b = step < 0 ? -1 : len;
    else {
        b = sp.u.i;
        if (b < 0) { b += len; if (b < 0) b = step < 0 ? -1 : 0; }
        else if (b >= len) b = step < 0 ? len - 1 : len;
    }
    *start = a;
    *stop = b;
    if (step < 0) return b < a ? (a - b - 1) / (-step) + 1 : 0;
    return a < b ? (b - a - 1) / step + 1 : 0;
}

/* Byte offsets of each code point in s (n bytes), plus the end: [count + 1]. NULL for pure ASCII. */
static size_t *cp_offsets(tpl_rctx_t *c, const char *s, size_t n, size_t *count, bool *fail)
{
    *fail = false;
    bool ascii = true;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) { ascii = false; break; }
    if (ascii) { *count = n; return NULL; }
    size_t k = prism_utf8_count(s, n);
    size_t *off = tpl_alloc(c, (k + 1) * sizeof(size_t));
    if (!off) { *fail = true; return NULL; }
    size_t j = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        off[j++] = i;
        i += prism_utf8_decode(s + i, n - i, &cp);
    }
    off[j] = n;
    *count = k;
    return off;
}

static int do_slice(tpl_rctx_t *c, tv_t obj, tv_t st, tv_t sp, tv_t stp, tv_t *out)
{
    /* jinja2 compiles slices to a plain Python subscript (no sandbox getitem fallback), so slicing
     * anything but a sequence is an error rather than undefined */
    if (is_undef(obj)) return undefined_error(c, obj);
    if (obj.t != TV_STR && !(tv_is_list(obj) && obj.u.o->sub != SEQ_ITER))
        return tpl_fail(c, PRISM_EINVAL, "'%s' object is not subscriptable", tpl_type_name(obj));
    if ((st.t != TV_NONE && !tv_is_intlike(st)) || (sp.t != TV_NONE && !tv_is_intlike(sp)) ||
        (stp.t != TV_NONE && !tv_is_intlike(stp)))
        return tpl_fail(c, PRISM_EINVAL, "slice indices must be integers or None");
    int64_t step = stp.t == TV_NONE ? 1 : stp.u.i;
    if (step == 0) return tpl_fail(c, PRISM_EINVAL, "slice step cannot be zero");
    if (step == INT64_MIN) step = INT64_MIN + 1;
    if (obj.t == TV_STR) {
        size_t count;
        bool fail;
        size_t *off = cp_offsets(c, obj.u.s.p, obj.u.s.n, &count, &fail);
        if (fail) return c->status;
        int64_t a, b;
        int64_t k = slice_indices((int64_t)count, st, sp, step, &a, &b);
        if (step == 1) {
            size_t s0 = off ? off[a] : (size_t)a;
            size_t s1 = off ? off[a + k] : (size_t)(a + k);
            *out = tv_str(obj.u.s.p + s0, s1 - s0);
            return 0;
        }
        tpl_sb_t sb = {0};
        for (int64_t i = 0, p = a; i < k; i++, p += step) {
            size_t s0 = off ? off[p] : (size_t)p, s1 = off ? off[p + 1] : (size_t)p + 1;
            if (tpl_sb_add(c, &sb, obj.u.s.p + s0, s1 - s0)) return c->status;
        }
        *out = tpl_sb_value(&sb);
        return 0;
    }
    if (tv_is_list(obj) && obj.u.o->sub != SEQ_ITER) {
        tobj_t *o = obj.u.o;
        int64_t a, b;
        int64_t k = slice_indices((int64_t)o->len, st, sp, step, &a, &b);
        tobj_t *l = tpl_list_new(c, o->sub == SEQ_RANGE ? SEQ_LIST : o->sub, (size_t)k);
        if (!l) return c->status;
        for (int64_t i = 0, p = a; i < k; i++, p += step) l->items[i] = o->items[p];
        l->len = (size_t)k;
        *out = tv_obj(l);
        return 0;
    }
    return tpl_fail(c, PRISM_EINVAL, "'%s' object is not subscriptable", tpl_type_name(obj));
}

int tpl_getitem(tpl_rctx_t *c, tv_t obj, tv_t key, tv_t *out)
{
    if (is_undef(obj)) return undefined_error(c, obj);
    if (obj.t == TV_OBJ) {
        tobj_t *o = obj.u.o;
        if (o->kind == OBJ_DICT) {
            if (tpl_dict_get(o, key, out)) return 0;
        } else if (o->kind == OBJ_LIST && o->sub != SEQ_ITER && tv_is_intlike(key)) {
            int64_t i = key.u.i, n = (int64_t)o->len;
            if (i < 0) i += n;
            if (i >= 0 && i < n) { *out = o->items[i]; return 0; }
            *out = tv_undef("index");
            return 0;
        }
    } else if (obj.t == TV_STR && tv_is_intlike(key)) {
        size_t count;
        bool fail;
        size_t *off = cp_offsets(c, obj.u.s.p, obj.u.s.n, &count, &fail);
        if (fail) return c->status;
        int64_t i = key.u.i, n = (int64_t)count;
        if (i < 0) i += n;
        if (i >= 0 && i < n) {
            size_t s0 = off ? off[i] : (size_t)i, s1 = off ? off[i + 1] : (size_t)i + 1;
            *out = tv_str(obj.u.s.p + s0, s1 - s0);
            return 0;
        }
        *out = tv_undef("index");
        return 0;
    }
    if (key.t == TV_STR) {
        char name[64];
        if (key.u.s.n < sizeof(name) && !memchr(key.u.s.p, 0, key.u.s.n)) {
            memcpy(name, key.u.s.p, key.u.s.n);
            name[key.u.s.n] = 0;
            tv_t r;
            if (tpl_getattr(c, obj, name, key.u.s.n, &r)) return c->status;
            if (r.t != TV_UNDEF) { *out = r; return 0; }
        }
        char *kn = tpl_alloc(c, key.u.s.n + 1);
        if (!kn) return c->status;
        memcpy(kn, key.u.s.p, key.u.s.n);
        kn[key.u.s.n] = 0;
        *out = tv_undef(kn);
        return 0;
    }
    *out = tv_undef("item");
    return 0;
}

/* ------------------------------------------------------------------ operators */

static int type_error2(tpl_rctx_t *c, const char *op, tv_t a, tv_t b)
{
    return tpl_fail(c, PRISM_EINVAL, "unsupported operand type(s) for %s: '%s' and '%s'", op, tpl_type_name(a),
                    tpl_type_name(b));
}

static int repeat(tpl_rctx_t *c, tv_t seq, int64_t times, tv_t *out)
{
    if (times < 0) times = 0;
    if (seq.t == TV_STR) {
        size_t n = seq.u.s.n;
        if (n && (uint64_t)times > PRISM_TEMPLATE_MAX_OUTPUT / n)
            return tpl_fail(c, PRISM_ELIMIT, "string repetition result too large");
        tpl_sb_t b = {0};
        if (tpl_sb_reserve(c, &b, n * (size_t)times)) return c->status;
        for (int64_t i = 0; i < times; i++) tpl_sb_add(c, &b, seq.u.s.p, n);
        *out = tpl_sb_value(&b);
        return c->status;
    }
    tobj_t *o = seq.u.o;
    if (o->len && (uint64_t)times > (1u << 20) / o->len)
        return tpl_fail(c, PRISM_ELIMIT, "list repetition result too large");
    tobj_t *l = tpl_list_new(c, o->sub, o->len * (size_t)times);
    if (!l) return c->status;
    for (int64_t i = 0; i < times; i++) {
        if (o->len) memcpy(l->items + l->len, o->items, o->len * sizeof(tv_t));
        l->len += o->len;
    }
    *out = tv_obj(l);
    return 0;
}

static double fnum(tv_t v) { return v.t == TV_FLOAT ? v.u.f : (double)v.u.i; }

static int int_overflow(tpl_rctx_t *c) { return tpl_fail(c, PRISM_ELIMIT, "integer overflow"); }

static int do_format(tpl_rctx_t *c, tv_t fmt, tv_t args, tv_t *out);

int tpl_binop(tpl_rctx_t *c, int op, tv_t a, tv_t b, tv_t *out)
{
    if (op == OP_TILDE) {
        tpl_sb_t sb = {0};
        if (tpl_write_str(c, &sb, a) || tpl_write_str(c, &sb, b)) return c->status;
        *out = tpl_sb_value(&sb);
        return 0;
    }
    if (op == OP_MOD && a.t == TV_STR) return do_format(c, a, b, out);
    if (is_undef(a)) return undefined_error(c, a);
    if (is_undef(b)) return undefined_error(c, b);
    bool ints = tv_is_intlike(a) && tv_is_intlike(b);
    bool nums = tv_is_num(a) && tv_is_num(b);
    int64_t r;
    switch (op) {
    case OP_ADD:
        if (ints) {
            if (__builtin_add_overflow(a.u.i, b.u.i, &r)) return int_overflow(c);
            *out = tv_int(r);
            return 0;
        }
        if (nums) { *out = tv_float(fnum(a) + fnum(b)); return 0; }
        if (a.t == TV_STR && b.t == TV_STR) {
            tpl_sb_t sb = {0};
            if (tpl_sb_reserve(c, &sb, a.u.s.n + b.u.s.n)) return c->status;
            tpl_sb_add(c, &sb, a.u.s.p, a.u.s.n);
            tpl_sb_add(c, &sb, b.u.s.p, b.u.s.n);
            *out = tpl_sb_value(&sb);
            return c->status;
        }
        if (tv_is_list(a) && tv_is_list(b) && a.u.o->sub == b.u.o->sub &&
            (a.u.o->sub == SEQ_LIST || a.u.o->sub == SEQ_TUPLE)) {
            tobj_t *l = tpl_list_new(c, a.u.o->sub, a.u.o->len + b.u.o->len);
            if (!l) return c->status;
            if (a.u.o->len) memcpy(l->items, a.u.o->items, a.u.o->len * sizeof(tv_t));
            if (b.u.o->len) memcpy(l->items + a.u.o->len, b.u.o->items, b.u.o->len * sizeof(tv_t));
            l->len = a.u.o->len + b.u.o->len;
            *out = tv_obj(l);
            return 0;
        }
        if (a.t == TV_STR)
            return tpl_fail(c, PRISM_EINVAL, "can only concatenate str (not \"%s\") to str", tpl_type_name(b));
        if (tv_is_seq(a, SEQ_LIST))
            return tpl_fail(c, PRISM_EINVAL, "can only concatenate list (not \"%s\") to list", tpl_type_name(b));
        return type_error2(c, "+", a, b);
    case OP_SUB:
        if (ints) {
            if (__builtin_sub_overflow(a.u.i, b.u.i, &r)) return int_overflow(c);
            *out = tv_int(r);
            return 0;
        }
        if (nums) { *out = tv_float(fnum(a) - fnum(b)); return 0; }
        return type_error2(c, "-", a, b);
    case OP_MUL:
        if (ints) {
            if (__builtin_mul_overflow(a.u.i, b.u.i, &r)) return int_overflow(c);
            *out = tv_int(r);
            return 0;
        }
        if (nums) { *out = tv_float(fnum(a) * fnum(b)); return 0; }
        if ((a.t == TV_STR || (tv_is_list(a) && (a.u.o->sub == SEQ_LIST || a.u.o->sub == SEQ_TUPLE))) && tv_is_intlike(b))
            return repeat(c, a, b.u.i, out);
        if ((b.t == TV_STR || (tv_is_list(b) && (b.u.o->sub == SEQ_LIST || b.u.o->sub == SEQ_TUPLE))) && tv_is_intlike(a))
            return repeat(c, b, a.u.i, out);
        return type_error2(c, "*", a, b);
    case OP_DIV:
        if (!nums) return type_error2(c, "/", a, b);
        if (fnum(b) == 0) return tpl_fail(c, PRISM_EINVAL, "division by zero");
        *out = tv_float(fnum(a) / fnum(b));
        return 0;
    case OP_FLOORDIV:
    case OP_MOD:
        if (a.t == TV_STR && op == OP_MOD) return do_format(c, a, b, out);
        if (!nums) return type_error2(c, op == OP_MOD ? "%" : "//", a, b);
        if (ints) {
            if (b.u.i == 0) return tpl_fail(c, PRISM_EINVAL, "integer division or modulo by zero");
            if (a.u.i == INT64_MIN && b.u.i == -1) return int_overflow(c);
            int64_t q = a.u.i / b.u.i, m = a.u.i % b.u.i;
            if (m != 0 && ((m < 0) != (b.u.i < 0))) { q -= 1; m += b.u.i; }
            *out = tv_int(op == OP_MOD ? m : q);
            return 0;
        } else {
            double x = fnum(a), y = fnum(b);
            if (y == 0) return tpl_fail(c, PRISM_EINVAL, "float division by zero");
            double mod = fmod(x, y), div;
            div = (x - mod) / y;
            if (mod != 0) {
                if ((y < 0) != (mod < 0)) { mod += y; div -= 1.0; }
            } else {
                mod = copysign(0.0, y);
            }
            double fl;
            if (div != 0) {
                fl = floor(div);
                if (div - fl > 0.5) fl += 1.0;
            } else {
                fl = copysign(0.0, x / y);
            }
            *out = tv_float(op == OP_MOD ? mod : fl);
            return 0;
        }
    case OP_POW:
        if (!nums) return type_error2(c, "** or pow()", a, b);
        if (ints && b.u.i >= 0) {
            int64_t base = a.u.i, e = b.u.i, acc = 1;
            while (e > 0) {
                if (e & 1) { if (__builtin_mul_overflow(acc, base, &acc)) return int_overflow(c); }
                e >>= 1;
                if (e && __builtin_mul_overflow(base, base, &base)) return int_overflow(c);
            }
            *out = tv_int(acc);
            return 0;
        }
        if (fnum(a) == 0 && fnum(b) < 0)
            return tpl_fail(c, PRISM_EINVAL, "0.0 cannot be raised to a negative power");
        *out = tv_float(pow(fnum(a), fnum(b)));
        return 0;
    }
    return tpl_fail(c, PRISM_EINVAL, "unknown operator");
}

/* printf-style formatting: "..." % args and the format filter. %s %r %d %i %f %% with an optional
 * precision for %f and %(name)s with a dict. */
static int do_format(tpl_rctx_t *c, tv_t fmt, tv_t args, tv_t *out)
{
    tpl_sb_t sb = {0};
    const char *s = fmt.u.s.p;
    size_t n = fmt.u.s.n, ai = 0;
    bool is_tuple = tv_is_seq(args, SEQ_TUPLE);
    bool used_single = false;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '%') { if (tpl_sb_addc(c, &sb, s[i])) return c->status; continue; }
        if (++i >= n) return tpl_fail(c, PRISM_EINVAL, "incomplete format");
        tv_t v;
        bool have = false;
        if (s[i] == '(') {
            size_t j = i + 1;
            while (j < n && s[j] != ')') j++;
            if (j >= n || !tv_is_dict(args)) return tpl_fail(c, PRISM_EINVAL, "format requires a mapping");
            if (!tpl_dict_get_str(args.u.o, s + i + 1, j - i - 1, &v))
                return tpl_fail(c, PRISM_EINVAL, "format key not found");
            have = true;
            i = j + 1;
            if (i >= n) return tpl_fail(c, PRISM_EINVAL, "incomplete format");
        }
        int prec = -1;
        if (s[i] == '.') {
            prec = 0;
            for (i++; i < n && s[i] >= '0' && s[i] <= '9'; i++)
                if (prec <= 50) prec = prec * 10 + (s[i] - '0');   /* no overflow however many digits */
            if (prec > 50) prec = 50;
            if (i >= n) return tpl_fail(c, PRISM_EINVAL, "incomplete format");
        }
        char conv = s[i];
        if (conv == '%') { tpl_sb_addc(c, &sb, '%'); continue; }
        if (!have) {
            if (is_tuple) {
                if (ai >= args.u.o->len) return tpl_fail(c, PRISM_EINVAL, "not enough arguments for format string");
                v = args.u.o->items[ai++];
            } else {
                if (used_single) return tpl_fail(c, PRISM_EINVAL, "not enough arguments for format string");
                v = args;
                used_single = true;
            }
        }
        char tmp[64];
        switch (conv) {
        case 's': if (tpl_write_str(c, &sb, v)) return c->status; break;
        case 'r': if (tpl_write_repr(c, &sb, v, 0)) return c->status; break;
        case 'd': case 'i':
            if (!tv_is_num(v)) return tpl_fail(c, PRISM_EINVAL, "%%d format: a real number is required, not %s", tpl_type_name(v));
            if (v.t == TV_FLOAT) {
                if (!isfinite(v.u.f) || fabs(v.u.f) > 9e18) return tpl_fail(c, PRISM_EINVAL, "cannot convert float");
                snprintf(tmp, sizeof(tmp), "%lld", (long long)v.u.f);
            } else {
                snprintf(tmp, sizeof(tmp), "%lld", (long long)v.u.i);
            }
            tpl_sb_add(c, &sb, tmp, strlen(tmp));
            break;
        case 'f': case 'F':
            if (!tv_is_num(v)) return tpl_fail(c, PRISM_EINVAL, "must be real number, not %s", tpl_type_name(v));
            snprintf(tmp, sizeof(tmp), "%.*f", prec < 0 ? 6 : prec, fnum(v));
            if (fabs(fnum(v)) >= 1e40) return tpl_fail(c, PRISM_ENOTSUP, "unsupported %%f of huge number");
            tpl_sb_add(c, &sb, tmp, strlen(tmp));
            break;
        default:
            return tpl_fail(c, PRISM_ENOTSUP, "unsupported format conversion '%%%c'", conv);
        }
    }
    /* Python only complains about an unused argument that is not a mapping-like object (anything with
     * __getitem__ other than str: lists, dicts, Undefined) */
    bool mapping_like = args.t == TV_UNDEF || args.t == TV_MISSING || tv_is_dict(args) ||
                        (tv_is_list(args) && args.u.o->sub != SEQ_ITER);
    if ((is_tuple && ai < args.u.o->len) || (!is_tuple && !used_single && !mapping_like))
        return tpl_fail(c, PRISM_EINVAL, "not all arguments converted during string formatting");
    *out = tpl_sb_value(&sb);
    return c->status;
}

int tpl_format_printf(tpl_rctx_t *c, tv_t fmt, tv_t args, tv_t *out) { return do_format(c, fmt, args, out); }

static bool hashable(tv_t v)
{
    if (v.t != TV_OBJ) return true;
    if (tv_is_seq(v, SEQ_TUPLE)) {
        for (size_t i = 0; i < v.u.o->len; i++)
            if (!hashable(v.u.o->items[i])) return false;
        return true;
    }
    return v.u.o->kind == OBJ_FUNC || v.u.o->kind == OBJ_NS || v.u.o->kind == OBJ_LOOP;
}

static int contains(tpl_rctx_t *c, tv_t needle, tv_t hay, bool *res)
{
    if (is_undef(hay)) { *res = false; return 0; }
    if (hay.t == TV_STR) {
        if (needle.t != TV_STR)
            return tpl_fail(c, PRISM_EINVAL, "'in <string>' requires string as left operand, not %s", tpl_type_name(needle));
        *res = needle.u.s.n == 0 || (needle.u.s.n <= hay.u.s.n &&
                                     tpl_memfind(hay.u.s.p, hay.u.s.n, needle.u.s.p, needle.u.s.n) != NULL);
        return 0;
    }
    if (tv_is_list(hay)) {
        tobj_t *o = hay.u.o;
        if (o->poison) return tpl_fail(c, PRISM_EINVAL, "%s", o->poison);
        size_t from = o->sub == SEQ_ITER ? o->pos : 0;
        for (size_t i = from; i < o->len; i++)
            if (tpl_eq(needle, o->items[i], 0)) {
                if (o->sub == SEQ_ITER) o->pos = i + 1;
                *res = true;
                return 0;
            }
        if (o->sub == SEQ_ITER) o->pos = o->len;
        *res = false;
        return 0;
    }
    if (tv_is_dict(hay)) {
        tv_t dummy;
        if (!hashable(needle)) return tpl_fail(c, PRISM_EINVAL, "unhashable type: '%s'", tpl_type_name(needle));
        *res = tpl_dict_get(hay.u.o, needle, &dummy);
        return 0;
    }
    return tpl_fail(c, PRISM_EINVAL, "argument of type '%s' is not iterable", tpl_type_name(hay));
}

/* ------------------------------------------------------------------ calls */

static int exec_body(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *body);

static int capture(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *body, tv_t *out)
{
    tpl_sb_t buf = {0};
    tpl_sb_t *saved = c->sink;
    c->sink = &buf;
    int rc = exec_body(c, s, body);
    c->sink = saved;
    if (rc) return rc; /* errors, and break/continue, which drop the buffered body like jinja2 does */
    *out = tpl_sb_value(&buf);
    return 0;
}

/* Binds macro/caller parameters per jinja2's Macro.__call__ and renders the body. */
static int call_macro(tpl_rctx_t *c, tobj_t *fn, int nargs, const tv_t *args, int nkw, const char **kwn,
                      const tv_t *kwv, tv_t *out)
{
    const tpl_node_t *m = fn->macro;
    bool is_caller = fn->sub == FN_CALLER;
    const char *mname = is_caller ? "caller" : m->name;
    if (c->call_depth >= PRISM_TEMPLATE_MAX_CALL_DEPTH)
        return tpl_fail(c, PRISM_ELIMIT, "macro calls nested deeper than %d", PRISM_TEMPLATE_MAX_CALL_DEPTH);
    /* macros close over the frame they were defined in (jinja2 compiles them to nested functions) */
    tpl_scope_t *s = scope_new(c, fn->scope ? fn->scope : c->root);
    if (!s) return c->status;
    int np = m->nnames;
    bool catch_varargs = m->flags & NF_VARARGS, catch_kwargs = m->flags & NF_KWARGS;
    bool wants_caller = !is_caller && (m->flags & NF_CALLER);
    if (nargs > np && !catch_varargs)
        return tpl_fail(c, PRISM_EINVAL, "macro '%s' takes not more than %d argument(s)", mname, np);
    tv_t *bound = tpl_alloc(c, (size_t)(np + 1) * sizeof(tv_t));
    if (!bound) return c->status;
    for (int i = 0; i < np; i++) bound[i] = i < nargs ? args[i] : tv_missing();
    tobj_t *kwd = NULL;
    tv_t caller = tv_undef("caller");
    for (int k = 0; k < nkw; k++) {
        int idx = -1;
        for (int i = 0; i < np; i++)
            if (!strcmp(m->names[i], kwn[k])) { idx = i; break; }
        if (idx >= 0) {
            if (bound[idx].t != TV_MISSING)
                return tpl_fail(c, PRISM_EINVAL, "macro '%s' got multiple values for argument '%s'", mname, kwn[k]);
            bound[idx] = kwv[k];
            continue;
        }
        if (wants_caller && !strcmp(kwn[k], "caller")) { caller = kwv[k]; continue; }
        if (!catch_kwargs) {
            if (!strcmp(kwn[k], "caller"))
                return tpl_fail(c, PRISM_EINVAL, "macro '%s' was invoked with two values for the special caller argument", mname);
            return tpl_fail(c, PRISM_EINVAL, "macro '%s' takes no keyword argument '%s'", mname, kwn[k]);
        }
        if (!kwd && !(kwd = tpl_dict_new(c, OBJ_DICT, 4))) return c->status;
        if (tpl_dict_set(c, kwd, tv_str(kwn[k], strlen(kwn[k])), kwv[k])) return c->status;
    }
    c->call_depth++;
    for (int i = 0; i < np; i++) {
        tv_t v = bound[i];
        if (v.t == TV_MISSING) {
            if (m->items[i]) {
                if (tpl_eval(c, s, m->items[i], &v)) { c->call_depth--; return c->status; }
            } else {
                v = tv_undef(m->names[i]);
            }
        }
        if (scope_set(c, s, m->names[i], v)) { c->call_depth--; return c->status; }
    }
    if (catch_varargs) {
        tobj_t *va = tpl_list_new(c, SEQ_TUPLE, nargs > np ? (size_t)(nargs - np) : 0);
        if (!va) { c->call_depth--; return c->status; }
        for (int i = np; i < nargs; i++) va->items[va->len++] = args[i];
        scope_set(c, s, "varargs", tv_obj(va));
    }
    if (catch_kwargs) {
        if (!kwd && !(kwd = tpl_dict_new(c, OBJ_DICT, 0))) { c->call_depth--; return c->status; }
        scope_set(c, s, "kwargs", tv_obj(kwd));
    }
    if (wants_caller) scope_set(c, s, "caller", caller);
    int rc = c->status ? c->status : capture(c, s, is_caller ? m->b : m->a, out);
    c->call_depth--;
    return rc < 0 ? rc : 0; /* break/continue cannot cross a macro body (rejected at compile time) */
}

int tpl_call_value(tpl_rctx_t *c, tpl_scope_t *s, tv_t fn, int nargs, const tv_t *args, int nkw,
                   const char **kwn, const tv_t *kwv, tv_t *out, int line)
{
    (void)s;
    (void)line;
    if (is_undef(fn)) return undefined_error(c, fn);
    if (fn.t != TV_OBJ || fn.u.o->kind != OBJ_FUNC)
        return tpl_fail(c, PRISM_EINVAL, "'%s' object is not callable", tpl_type_name(fn));
    tobj_t *f = fn.u.o;
    tpl_args_t a = {nargs, args, nkw, kwn, kwv};
    switch (f->sub) {
    case FN_GLOBAL: return tpl_call_global(c, f->fid, &a, out);
    case FN_METHOD: return tpl_call_method(c, f->recv, f->fid, &a, out);
    case FN_MACRO:
    case FN_CALLER: return call_macro(c, f, nargs, args, nkw, kwn, kwv, out);
    }
    return tpl_fail(c, PRISM_EINVAL, "object is not callable");
}

/* Evaluates positional and keyword argument expressions of a call/filter/test node. */
static int eval_args(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, int extra, tv_t **args, tv_t **kwv)
{
    *args = tpl_alloc(c, (size_t)(n->nitems + extra + 1) * sizeof(tv_t));
    *kwv = tpl_alloc(c, (size_t)(n->nitems2 + 1) * sizeof(tv_t));
    if (!*args || !*kwv) return c->status;
    for (int i = 0; i < n->nitems; i++)
        if (tpl_eval(c, s, n->items[i], &(*args)[i + extra])) return c->status;
    for (int i = 0; i < n->nitems2; i++)
        if (tpl_eval(c, s, n->items2[i], &(*kwv)[i])) return c->status;
    return 0;
}

static int eval_call(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, const char *extra_kw, tv_t extra_val,
                     tv_t *out)
{
    tv_t fn;
    const tpl_node_t *callee = n->a;
    tv_t recv;
    int fid = -1;
    if (callee->kind == E_GETATTR) {
        if (tpl_eval(c, s, callee->a, &recv)) return c->status;
        if (is_undef(recv)) return undefined_error(c, recv);
        fid = tpl_method_lookup(recv, callee->name, strlen(callee->name));
        if (fid < 0 && tpl_getattr(c, recv, callee->name, strlen(callee->name), &fn)) return c->status;
    } else if (tpl_eval(c, s, callee, &fn)) {
        return c->status;
    }
    tv_t *args, *kwv;
    if (eval_args(c, s, n, 0, &args, &kwv)) return c->status;
    int nkw = n->nitems2;
    const char **kwn = n->names;
    if (extra_kw) {
        const char **kn2 = tpl_alloc(c, (size_t)(nkw + 1) * sizeof(*kn2));
        if (!kn2) return c->status;
        if (nkw) memcpy(kn2, kwn, (size_t)nkw * sizeof(*kn2));
        kn2[nkw] = extra_kw;
        kwv[nkw] = extra_val;
        kwn = kn2;
        nkw++;
    }
    if (fid >= 0) {
        tpl_args_t a = {n->nitems, args, nkw, kwn, kwv};
        return tpl_call_method(c, recv, fid, &a, out);
    }
    return tpl_call_value(c, s, fn, n->nitems, args, nkw, kwn, kwv, out, n->line);
}

/* ------------------------------------------------------------------ expressions */

static int eval_name(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, tv_t *out)
{
    if (scope_get(s, n->name, out)) return 0;
    int g = tpl_global_lookup(n->name);
    if (g >= 0) {
        tobj_t *f = tpl_func_new(c, FN_GLOBAL, g);
        if (!f) return c->status;
        *out = tv_obj(f);
        return 0;
    }
    *out = tv_undef(n->name);
    return 0;
}

/* Each expression and statement being evaluated is a C frame or more: the tree of a chain
 * "1-1-1-..." is as deep as it is long, and macros recurse, so the depth is counted and bounded
 * (PRISM_TEMPLATE_MAX_EVAL_DEPTH) rather than left to the stack. */
static bool eval_enter(tpl_rctx_t *c)
{
    if (c->eval_depth >= PRISM_TEMPLATE_MAX_EVAL_DEPTH) {
        tpl_fail(c, PRISM_ELIMIT, "template evaluation nested deeper than %d", PRISM_TEMPLATE_MAX_EVAL_DEPTH);
        return false;
    }
    c->eval_depth++;
    return true;
}

static int eval_node(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, tv_t *out);

int tpl_eval(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, tv_t *out)
{
    if (c->status) return c->status;
    if (!eval_enter(c)) return c->status;
    int rc = eval_node(c, s, n, out);
    c->eval_depth--;
    return rc;
}

static int eval_node(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, tv_t *out)
{
    switch (n->kind) {
    case E_CONST: *out = n->val; return 0;
    case E_NAME: return eval_name(c, s, n, out);
    case E_LIST:
    case E_TUPLE: {
        tobj_t *l = tpl_list_new(c, n->kind == E_LIST ? SEQ_LIST : SEQ_TUPLE, (size_t)n->nitems);
        if (!l) return c->status;
        for (int i = 0; i < n->nitems; i++)
            if (tpl_eval(c, s, n->items[i], &l->items[i])) return c->status;
        l->len = (size_t)n->nitems;
        *out = tv_obj(l);
        return 0;
    }
    case E_DICT: {
        tobj_t *d = tpl_dict_new(c, OBJ_DICT, (size_t)n->nitems);
        if (!d) return c->status;
        for (int i = 0; i < n->nitems; i++) {
            tv_t k, v;
            if (tpl_eval(c, s, n->items[i], &k) || tpl_eval(c, s, n->items2[i], &v)) return c->status;
            if (!hashable(k)) return tpl_fail(c, PRISM_EINVAL, "unhashable type: '%s'", tpl_type_name(k));
            if (tpl_dict_set(c, d, k, v)) return c->status;
        }
        *out = tv_obj(d);
        return 0;
    }
    case E_GETATTR: {
        tv_t o;
        if (tpl_eval(c, s, n->a, &o)) return c->status;
        return tpl_getattr(c, o, n->name, strlen(n->name), out);
    }
    case E_GETITEM: {
        tv_t o, k;
        if (tpl_eval(c, s, n->a, &o) || tpl_eval(c, s, n->b, &k)) return c->status;
        return tpl_getitem(c, o, k, out);
    }
    case E_SLICE: {
        tv_t o, a = tv_none(), b = tv_none(), st = tv_none();
        if (tpl_eval(c, s, n->a, &o)) return c->status;
        if (n->b && tpl_eval(c, s, n->b, &a)) return c->status;
        if (n->c && tpl_eval(c, s, n->c, &b)) return c->status;
        if (n->d && tpl_eval(c, s, n->d, &st)) return c->status;
        return do_slice(c, o, a, b, st, out);
    }
    case E_CALL: return eval_call(c, s, n, NULL, tv_none(), out);
    case E_FILTER: {
        tv_t v;
        if (n->a) { if (tpl_eval(c, s, n->a, &v)) return c->status; }
        else v = c->filter_input;
        tv_t *args, *kwv;
        if (eval_args(c, s, n, 0, &args, &kwv)) return c->status;
        tpl_args_t a = {n->nitems, args, n->nitems2, n->names, kwv};
        return tpl_apply_filter(c, s, n->id, v, &a, out, n->line);
    }
    case E_TEST: {
        tv_t v;
        if (tpl_eval(c, s, n->a, &v)) return c->status;
        tv_t *args, *kwv;
        if (eval_args(c, s, n, 0, &args, &kwv)) return c->status;
        tpl_args_t a = {n->nitems, args, n->nitems2, n->names, kwv};
        bool r;
        if (tpl_apply_test(c, n->id, v, &a, &r, n->line)) return c->status;
        *out = tv_bool((n->flags & NF_NEGATED) ? !r : r);
        return 0;
    }
    case E_NOT: {
        tv_t v;
        if (tpl_eval(c, s, n->a, &v)) return c->status;
        *out = tv_bool(!tpl_truthy(v));
        return 0;
    }
    case E_NEG:
    case E_POS: {
        tv_t v;
        if (tpl_eval(c, s, n->a, &v)) return c->status;
        if (is_undef(v)) return undefined_error(c, v);
        if (v.t == TV_FLOAT) { *out = tv_float(n->kind == E_NEG ? -v.u.f : v.u.f); return 0; }
        if (tv_is_intlike(v)) {
            if (n->kind == E_NEG && v.u.i == INT64_MIN) return int_overflow(c);
            *out = tv_int(n->kind == E_NEG ? -v.u.i : v.u.i);
            return 0;
        }
        return tpl_fail(c, PRISM_EINVAL, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+',
                        tpl_type_name(v));
    }
    case E_BIN: {
        tv_t a, b;
        if (tpl_eval(c, s, n->a, &a)) return c->status;
        if (n->op == OP_AND) {
            if (!tpl_truthy(a)) { *out = a; return 0; }
            return tpl_eval(c, s, n->b, out);
        }
        if (n->op == OP_OR) {
            if (tpl_truthy(a)) { *out = a; return 0; }
            return tpl_eval(c, s, n->b, out);
        }
        if (tpl_eval(c, s, n->b, &b)) return c->status;
        return tpl_binop(c, n->op, a, b, out);
    }
    case E_CMP: {
        tv_t left;
        if (tpl_eval(c, s, n->a, &left)) return c->status;
        for (int i = 0; i < n->nitems; i++) {
            tv_t right;
            if (tpl_eval(c, s, n->items[i], &right)) return c->status;
            bool r = false;
            int op = n->ops[i], cr = 0;
            switch (op) {
            case OP_EQ: r = tpl_eq(left, right, 0); break;
            case OP_NE: r = !tpl_eq(left, right, 0); break;
            case OP_IN:
            case OP_NOTIN:
                if (contains(c, left, right, &r)) return c->status;
                if (op == OP_NOTIN) r = !r;
                break;
            default:
                if (tpl_cmp(c, left, right, &cr, 0)) return c->status;
                r = op == OP_LT ? cr < 0 : op == OP_LE ? cr <= 0 : op == OP_GT ? cr > 0 : cr >= 0;
                if (tv_is_num(left) && tv_is_num(right) && (isnan(fnum(left)) || isnan(fnum(right)))) r = false;
            }
            if (!r) { *out = tv_bool(false); return 0; }
            left = right;
        }
        *out = tv_bool(true);
        return 0;
    }
    case E_COND: {
        tv_t cond;
        if (tpl_eval(c, s, n->a, &cond)) return c->status;
        if (tpl_truthy(cond)) return tpl_eval(c, s, n->b, out);
        if (n->c) return tpl_eval(c, s, n->c, out);
        *out = tv_undef("conditional expression");
        return 0;
    }
    default:
        return tpl_fail(c, PRISM_EINVAL, "internal: statement used as expression");
    }
}

/* ------------------------------------------------------------------ statements */

static int assign_targets(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n, tv_t v)
{
    if (!(n->flags & NF_TARGET_TUPLE)) return scope_set(c, s, n->names[0], v);
    if (is_undef(v)) return undefined_error(c, v);
    tobj_t *items;
    if (tpl_iterate(c, v, &items)) return c->status;
    if ((int64_t)items->len != n->nnames)
        return tpl_fail(c, PRISM_EINVAL, items->len > (size_t)n->nnames ? "too many values to unpack (expected %d)"
                                                                         : "not enough values to unpack (expected %d)",
                        n->nnames);
    for (int i = 0; i < n->nnames; i++)
        if (scope_set(c, s, n->names[i], items->items[i])) return c->status;
    return 0;
}

static int count_iteration(tpl_rctx_t *c)
{
    if (++c->iterations > PRISM_TEMPLATE_MAX_ITERATIONS)
        return tpl_fail(c, PRISM_ELIMIT, "template exceeded %d loop iterations", PRISM_TEMPLATE_MAX_ITERATIONS);
    return 0;
}

static int exec_for(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n)
{
    tv_t it;
    if (tpl_eval(c, s, n->a, &it)) return c->status;
    tobj_t *items;
    if (tpl_iterate(c, it, &items)) return c->status;
    tpl_scope_t *ls = scope_new(c, s);
    if (!ls) return c->status;
    if (n->b) {
        tobj_t *kept = tpl_list_new(c, SEQ_LIST, items->len);
        if (!kept) return c->status;
        for (size_t i = 0; i < items->len; i++) {
            if (count_iteration(c)) return c->status;
            ls->n = 0;
            if (assign_targets(c, ls, n, items->items[i])) return c->status;
            tv_t cond;
            if (tpl_eval(c, ls, n->b, &cond)) return c->status;
            if (tpl_truthy(cond)) kept->items[kept->len++] = items->items[i];
        }
        items = kept;
    }
    bool completed = false; /* jinja2 clears its "run else" flag at the end of the body, so an
                               iteration left by break/continue does not count */
    tobj_t *loop = tpl_alloc(c, sizeof(*loop));
    if (!loop) return c->status;
    memset(loop, 0, sizeof(*loop));
    loop->kind = OBJ_LOOP;
    loop->length = (int64_t)items->len;
    loop->loop_items = items;
    loop->depth = 1;
    for (size_t i = 0; i < items->len; i++) {
        if (count_iteration(c)) return c->status;
        ls->n = 0; /* each iteration starts from the enclosing frame, as jinja2 does */
        loop->index0 = (int64_t)i;
        if (scope_set(c, ls, "loop", tv_obj(loop))) return c->status;
        if (assign_targets(c, ls, n, items->items[i])) return c->status;
        int rc = exec_body(c, ls, n->c);
        if (rc < 0) return rc;
        if (rc == TPL_BREAK) break;
        if (rc == 0) completed = true;
    }
    if (completed || !n->d) return 0;
    ls->n = 0;
    return exec_body(c, ls, n->d);
}

static int exec_node(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n);

/* 0, TPL_BREAK, TPL_CONTINUE, or the status of a failure. */
static int exec_stmt(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n)
{
    if (!eval_enter(c)) return c->status;
    int rc = exec_node(c, s, n);
    c->eval_depth--;
    return rc;
}

static int exec_node(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *n)
{
    switch (n->kind) {
    case S_BODY: return exec_body(c, s, n);
    case S_TEXT: return tpl_sb_add(c, c->sink, n->val.u.s.p, n->val.u.s.n);
    case S_OUT: {
        tv_t v;
        if (tpl_eval(c, s, n->a, &v)) return c->status;
        return tpl_write_str(c, c->sink, v);
    }
    case S_IF:
        for (const tpl_node_t *x = n; x;) {
            tv_t cond;
            if (tpl_eval(c, s, x->a, &cond)) return c->status;
            if (tpl_truthy(cond)) return exec_body(c, s, x->b);
            if (!x->c) return 0;
            if (x->c->kind == S_IF) { x = x->c; continue; }
            return exec_body(c, s, x->c);
        }
        return 0;
    case S_FOR: return exec_for(c, s, n);
    case S_SET: {
        tv_t v;
        if (tpl_eval(c, s, n->a, &v)) return c->status;
        if (n->flags & NF_NSATTR) {
            tv_t ns;
            if (!scope_get(s, n->name, &ns) || ns.t != TV_OBJ || ns.u.o->kind != OBJ_NS)
                return tpl_fail(c, PRISM_EINVAL, "cannot assign attribute on non-namespace object");
            if (n->names[0][0] == '_')
                return tpl_fail(c, PRISM_EINVAL, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%s'.", n->names[0]);
            return tpl_dict_set(c, ns.u.o, tv_str(n->names[0], strlen(n->names[0])), v);
        }
        return assign_targets(c, s, n, v);
    }
    case S_SETBLOCK: {
        tpl_scope_t *bs = scope_new(c, s);
        tv_t v;
        if (!bs) return c->status;
        int crc = capture(c, bs, n->a, &v);
        if (crc) return crc;
        if (n->b) {
            tv_t saved = c->filter_input;
            c->filter_input = v;
            int rc = tpl_eval(c, s, n->b, &v);
            c->filter_input = saved;
            if (rc) return rc;
        }
        return scope_set(c, s, n->name, v);
    }
    case S_MACRO: {
        tobj_t *f = tpl_func_new(c, FN_MACRO, 0);
        if (!f) return c->status;
        f->macro = n;
        f->scope = s; /* scopes live in the render pool until the render ends */
        return scope_set(c, s, n->name, tv_obj(f));
    }
    case S_CALLBLOCK: {
        tobj_t *f = tpl_func_new(c, FN_CALLER, 0);
        if (!f) return c->status;
        f->macro = n;
        f->scope = s;
        tv_t v;
        int rc = eval_call(c, s, n->a, "caller", tv_obj(f), &v);
        if (rc) return rc;
        return tpl_write_str(c, c->sink, v);
    }
    case S_FILTERBLOCK: {
        tpl_scope_t *bs = scope_new(c, s);
        tv_t v;
        if (!bs) return c->status;
        int crc = capture(c, bs, n->b, &v);
        if (crc) return crc;
        tv_t saved = c->filter_input;
        c->filter_input = v;
        int rc = tpl_eval(c, s, n->a, &v);
        c->filter_input = saved;
        if (rc) return rc;
        return tpl_write_str(c, c->sink, v);
    }
    case S_WITH: {
        tpl_scope_t *ws = scope_new(c, s);
        if (!ws) return c->status;
        for (int i = 0; i < n->nnames; i++) {
            tv_t v;
            if (tpl_eval(c, s, n->items[i], &v) || scope_set(c, ws, n->names[i], v)) return c->status;
        }
        return exec_body(c, ws, n->a);
    }
    case S_BREAK: return TPL_BREAK;
    case S_CONTINUE: return TPL_CONTINUE;
    default: return tpl_fail(c, PRISM_EINVAL, "internal: expression used as statement");
    }
}

static int exec_body(tpl_rctx_t *c, tpl_scope_t *s, const tpl_node_t *body)
{
    for (int i = 0; i < body->nitems; i++) {
        int rc = exec_stmt(c, s, body->items[i]);
        if (rc) return rc;
        if (c->status) return c->status;
    }
    return 0;
}

/* ------------------------------------------------------------------ entry */

int prism_template_render(const prism_template_t *t, const json_t *context, prism_buf_t *out, char *err,
                          size_t errlen)
{
    if (err && errlen) err[0] = 0;
    if (!t || !out) return PRISM_EINVAL;
    if (context && !json_is_object(context)) {
        if (err && errlen) snprintf(err, errlen, "template context must be a JSON object");
        return PRISM_EINVAL;
    }
    tpl_rctx_t c;
    memset(&c, 0, sizeof(c));
    c.t = t;
    c.err = err;
    c.errlen = errlen;
    tpl_pool_init(&c.pool, PRISM_TEMPLATE_MAX_MEMORY);
    int rc;
    c.root = scope_new(&c, NULL);
    if (!c.root) { rc = c.status; goto fail; }
    if (context) {
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)context, key, val) {
            tv_t v;
            if (tpl_from_json(&c, val, &v, 0)) { rc = c.status; goto fail; }
            if (scope_set(&c, c.root, key, v)) { rc = c.status; goto fail; }
        }
        json_t *ft = json_object_get(context, "__prism_fixed_time");
        if (json_is_integer(ft)) {
            c.fixed_time = true;
            c.fixed_time_s = json_integer_value(ft);
        }
    }
    if (!c.fixed_time) {
        const char *env = getenv("PRISM_TEMPLATE_FIXED_TIME");
        if (env && *env) {
            c.fixed_time = true;
            c.fixed_time_s = strtoll(env, NULL, 10);
        }
    }
    tpl_sb_t top = {0};
    c.sink = &top;
    rc = exec_body(&c, c.root, t->root);
    if (rc > 0) rc = 0; /* break/continue are rejected outside loops at compile time */
    if (!rc) rc = c.status;
    if (rc) goto fail;
    if (top.n && prism_buf_append(out, top.p, top.n)) {
        rc = PRISM_ENOMEM;
        if (err && errlen) snprintf(err, errlen, "out of memory");
        goto fail;
    }
    tpl_pool_free(&c.pool);
    return 0;
fail:
    if (err && errlen && !err[0]) snprintf(err, errlen, "%s", prism_strerror(rc));
    tpl_pool_free(&c.pool);
    return rc;
}
