/* Guide source -> grammar, and the bounded cache of compiled guides. See guide.h. */
#include "guide/guide.h"
#include "toolcall/toolcall.h"

#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#define GUIDE_DEFAULT_ENTRIES 64
#define GUIDE_DEFAULT_TEXT_BYTES (16u << 20)

struct prism_guide {
    atomic_int refs;
    uint64_t hash;
    prism_guide_spec_t spec;      /* text / tool_name point at the copies below */
    char *text, *tool_name;
    prism_grammar_t *g;
};

typedef struct {
    prism_guide_t *g;             /* NULL = empty */
    uint64_t last_use;
} guide_slot_t;

struct prism_guide_cache {
    pthread_mutex_t lock;         /* slots, clock, stats; never held while compiling */
    const prism_grammar_vocab_t *v;
    guide_slot_t *slots;
    int n_slots;
    size_t max_text, text_bytes;
    uint64_t clock;
    prism_guide_cache_stats_t st;
};

static void set_err(prism_grammar_error_t *err, int code, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void set_err(prism_grammar_error_t *err, int code, const char *path, const char *fmt, ...)
{
    if (!err) return;
    err->code = code;
    snprintf(err->path, sizeof err->path, "%s", path ? path : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

static int compile_choice(const prism_grammar_vocab_t *v, const prism_guide_spec_t *s, prism_grammar_t **out,
                          prism_grammar_error_t *err)
{
    json_error_t je;
    json_t *arr = json_loadb(s->text ? s->text : "", s->len, 0, &je);
    int rc = PRISM_EINVAL;
    size_t n = json_is_array(arr) ? json_array_size(arr) : 0;
    const char **items = NULL;
    size_t *lens = NULL;
    if (!json_is_array(arr)) {
        set_err(err, PRISM_EINVAL, "", "the choices must be a JSON array of strings");
        goto done;
    }
    if (n == 0 || n > PRISM_GUIDE_MAX_CHOICES) {
        set_err(err, n ? PRISM_ELIMIT : PRISM_EINVAL, "", "between 1 and %d choices are allowed, got %zu",
                PRISM_GUIDE_MAX_CHOICES, n);
        rc = n ? PRISM_ELIMIT : PRISM_EINVAL;
        goto done;
    }
    items = prism_malloc(n * sizeof *items);
    lens = prism_malloc(n * sizeof *lens);
    if (!items || !lens) {
        set_err(err, PRISM_ENOMEM, "", "out of memory");
        rc = PRISM_ENOMEM;
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *c = json_array_get(arr, i);
        if (!json_is_string(c)) {
            char p[32];
            snprintf(p, sizeof p, "[%zu]", i);
            set_err(err, PRISM_EINVAL, p, "each choice must be a string");
            goto done;
        }
        items[i] = json_string_value(c);
        lens[i] = json_string_length(c);
    }
    rc = prism_grammar_compile_choice(v, items, lens, n, NULL, out, err);
done:
    prism_free(items);
    prism_free(lens);
    json_decref(arr);
    return rc;
}

int prism_guide_compile(const prism_grammar_vocab_t *v, const prism_guide_spec_t *s, prism_grammar_t **out,
                        prism_grammar_error_t *err)
{
    *out = NULL;
    if (err) memset(err, 0, sizeof *err);
    const char *text = s->text ? s->text : "";
    switch (s->kind) {
    case PRISM_GUIDE_JSON_SCHEMA:
        return prism_grammar_compile_json_schema(v, text, s->len, NULL, NULL, out, err);
    case PRISM_GUIDE_JSON_OBJECT:
        return prism_grammar_compile_json_object(v, NULL, NULL, out, err);
    case PRISM_GUIDE_REGEX:
        return prism_grammar_compile_regex(v, text, s->len, NULL, out, err);
    case PRISM_GUIDE_CHOICE:
        return compile_choice(v, s, out, err);
    case PRISM_GUIDE_TOOLS:
        if (s->tool_format != PRISM_TOOLCALL_HERMES && s->tool_format != PRISM_TOOLCALL_PYTHONIC) {
            set_err(err, PRISM_EINVAL, "", "unknown tool-call format %d", s->tool_format);
            return PRISM_EINVAL;
        }
        return prism_toolcall_grammar((prism_toolcall_format_t)s->tool_format, v, text, s->len,
                                      s->tool_name && *s->tool_name ? s->tool_name : NULL, s->tool_parallel, NULL,
                                      out, err);
    default:
        set_err(err, PRISM_EINVAL, "", "unknown guide kind %d", s->kind);
        return PRISM_EINVAL;
    }
}

/* ---- guides ---- */

static uint64_t spec_hash(const prism_guide_spec_t *s)
{
    char head[PRISM_GUIDE_MAX_TOOL_NAME + 32];
    const char *name = s->kind == PRISM_GUIDE_TOOLS && s->tool_name ? s->tool_name : "";
    int n = snprintf(head, sizeof head, "%d/%d/%d/%.*s", s->kind, s->kind == PRISM_GUIDE_TOOLS ? s->tool_format : 0,
                     s->kind == PRISM_GUIDE_TOOLS ? (int)s->tool_parallel : 0, PRISM_GUIDE_MAX_TOOL_NAME, name);
    uint64_t seed = XXH3_64bits(head, (size_t)PRISM_MIN(n, (int)sizeof head - 1));
    return XXH3_64bits_withSeed(s->len ? s->text : "", s->len, seed);
}

static bool spec_equal(const prism_guide_spec_t *a, const prism_guide_spec_t *b)
{
    if (a->kind != b->kind || a->len != b->len || (a->len && memcmp(a->text, b->text, a->len))) return false;
    if (a->kind != PRISM_GUIDE_TOOLS) return true;
    const char *na = a->tool_name ? a->tool_name : "", *nb = b->tool_name ? b->tool_name : "";
    return a->tool_format == b->tool_format && a->tool_parallel == b->tool_parallel && !strcmp(na, nb);
}

void prism_guide_retain(prism_guide_t *g)
{
    if (g) atomic_fetch_add(&g->refs, 1);
}

void prism_guide_release(prism_guide_t *g)
{
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    prism_grammar_release(g->g);
    prism_free(g->text);
    prism_free(g->tool_name);
    prism_free(g);
}

prism_grammar_t *prism_guide_grammar(const prism_guide_t *g) { return g->g; }
const prism_guide_spec_t *prism_guide_spec(const prism_guide_t *g) { return &g->spec; }

static int guide_new(const prism_grammar_vocab_t *v, const prism_guide_spec_t *s, uint64_t hash, prism_guide_t **out,
                     prism_grammar_error_t *err)
{
    prism_guide_t *g = prism_calloc(1, sizeof *g);
    if (!g) {
        set_err(err, PRISM_ENOMEM, "", "out of memory");
        return PRISM_ENOMEM;
    }
    int rc = prism_guide_compile(v, s, &g->g, err);
    if (rc < 0) {
        prism_free(g);
        return rc;
    }
    const char *name = s->kind == PRISM_GUIDE_TOOLS && s->tool_name ? s->tool_name : "";
    g->text = prism_strndup(s->text ? s->text : "", s->len);
    g->tool_name = prism_strdup(name);
    if (!g->text || !g->tool_name) {
        g->refs = 1;
        prism_guide_release(g);
        set_err(err, PRISM_ENOMEM, "", "out of memory");
        return PRISM_ENOMEM;
    }
    atomic_init(&g->refs, 1);
    g->hash = hash;
    g->spec = *s;
    g->spec.text = g->text;
    g->spec.tool_name = g->tool_name;
    *out = g;
    return PRISM_OK;
}

/* ---- cache ---- */

int prism_guide_cache_create(const prism_grammar_vocab_t *v, int max_entries, size_t max_text_bytes,
                             prism_guide_cache_t **out)
{
    *out = NULL;
    prism_guide_cache_t *c = prism_calloc(1, sizeof *c);
    if (!c) return PRISM_ENOMEM;
    c->v = v;
    c->n_slots = max_entries > 0 ? max_entries : GUIDE_DEFAULT_ENTRIES;
    c->max_text = max_text_bytes ? max_text_bytes : GUIDE_DEFAULT_TEXT_BYTES;
    c->slots = prism_calloc((size_t)c->n_slots, sizeof *c->slots);
    if (!c->slots) {
        prism_free(c);
        return PRISM_ENOMEM;
    }
    pthread_mutex_init(&c->lock, NULL);
    *out = c;
    return PRISM_OK;
}

static void slot_clear(prism_guide_cache_t *c, guide_slot_t *s)
{
    c->text_bytes -= s->g->spec.len;
    c->st.entries--;
    prism_guide_release(s->g);
    s->g = NULL;
}

void prism_guide_cache_destroy(prism_guide_cache_t *c)
{
    if (!c) return;
    for (int i = 0; i < c->n_slots; i++)
        if (c->slots[i].g) slot_clear(c, &c->slots[i]);
    pthread_mutex_destroy(&c->lock);
    prism_free(c->slots);
    prism_free(c);
}

/* The cached guide for s (a reference of the caller's), or NULL; under c->lock. */
static prism_guide_t *lookup(prism_guide_cache_t *c, const prism_guide_spec_t *s, uint64_t h)
{
    c->clock++;
    for (int i = 0; i < c->n_slots; i++) {
        guide_slot_t *sl = &c->slots[i];
        if (sl->g && sl->g->hash == h && spec_equal(&sl->g->spec, s)) {
            sl->last_use = c->clock;
            prism_guide_retain(sl->g);
            return sl->g;
        }
    }
    return NULL;
}

/* Keeps g (its text within the bound), evicting the least recently used; under c->lock. */
static void insert(prism_guide_cache_t *c, prism_guide_t *g)
{
    size_t len = g->spec.len;
    if (len > c->max_text) return;
    for (;;) {
        guide_slot_t *empty = NULL, *lru = NULL;
        for (int i = 0; i < c->n_slots; i++) {
            guide_slot_t *sl = &c->slots[i];
            if (!sl->g) { if (!empty) empty = sl; }
            else if (!lru || sl->last_use < lru->last_use) lru = sl;
        }
        if (empty && c->text_bytes + len <= c->max_text) {
            prism_guide_retain(g);
            empty->g = g;
            empty->last_use = c->clock;
            c->text_bytes += len;
            c->st.entries++;
            return;
        }
        if (!lru) return;
        slot_clear(c, lru);
        c->st.evictions++;
    }
}

int prism_guide_get(prism_guide_cache_t *c, const prism_guide_spec_t *s, prism_guide_t **out,
                    prism_grammar_error_t *err)
{
    *out = NULL;
    if (err) memset(err, 0, sizeof *err);
    uint64_t h = spec_hash(s);
    pthread_mutex_lock(&c->lock);
    prism_guide_t *g = lookup(c, s, h);
    if (g) c->st.hits++;
    else c->st.misses++;
    pthread_mutex_unlock(&c->lock);
    if (g) {
        *out = g;
        return PRISM_OK;
    }
    /* compiled outside the lock (bounded by the grammar's compile budget), so threads sharing the
     * cache never wait for each other's compiles; two that raced keep the first one cached */
    int rc = guide_new(c->v, s, h, &g, err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&c->lock);
    prism_guide_t *had = lookup(c, s, h);
    if (!had) insert(c, g);
    pthread_mutex_unlock(&c->lock);
    if (had) {
        prism_guide_release(g);
        g = had;
    }
    *out = g;
    return PRISM_OK;
}

void prism_guide_cache_stats(prism_guide_cache_t *c, prism_guide_cache_stats_t *out)
{
    pthread_mutex_lock(&c->lock);
    *out = c->st;
    out->text_bytes = c->text_bytes;
    pthread_mutex_unlock(&c->lock);
}
