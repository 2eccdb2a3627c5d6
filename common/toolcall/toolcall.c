/* Tool-call parsers (hermes, pythonic): one incremental state machine per format over the text
 * received so far. Every step consumes a complete construct or waits for more text (at finish,
 * end of text is the lookahead), so the events do not depend on how the text was split. */
#define _GNU_SOURCE 1   /* memmem */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "toolcall/toolcall.h"
#include "core/utf8.h"

#define TC_DEFAULT_MAX (1u << 20)
#define TC_MAX_NEST 64

static const char HERMES_OPEN[] = "<tool_call>";
static const char HERMES_CLOSE[] = "</tool_call>";
static const char PY_START[] = "<|python_start|>";
static const char PY_END[] = "<|python_end|>";

typedef enum {
    /* hermes */
    H_CONTENT, H_OBJ_START, H_KEY, H_COLON, H_VALUE, H_NAME, H_ARGS_RAW, H_ARGS_STR, H_SKIP_VALUE, H_AFTER_VALUE,
    H_CLOSE,
    /* pythonic */
    P_START, P_CALL, P_KW, P_EQ, P_VALUE, P_AFTER_VALUE, P_DICT_KEY, P_DICT_COLON, P_STRING, P_AFTER_CALL,
    P_END,
    /* both */
    S_CONTENT_ALL,
} tc_state_t;

struct prism_toolcall_parser {
    prism_toolcall_format_t fmt;
    uint64_t id_seed;
    size_t max_bytes;
    int max_calls;         /* events of calls from this index on are not sent (0: any number) */
    prism_toolcall_cb cb;
    void *ud;
    prism_buf_t buf;       /* all text received */
    size_t pos;            /* everything before pos is decided */
    tc_state_t st;
    bool finishing, finished, bad;
    int n_calls;
    bool call_open;        /* CALL_BEGIN sent, call not closed */
    int n_complete;
    bool after_call;       /* hermes: nothing but whitespace since the last call closed */
    /* hermes: the current call object */
    char key[16];          /* current key, truncated ("name", "arguments", other) */
    bool have_name, have_args;
    prism_buf_t pending;   /* arguments seen before the name */
    int depth;             /* raw value scan */
    bool in_str, esc, val_started;
    /* pythonic */
    char stack[TC_MAX_NEST];  /* open containers: ']' ')' '}' */
    int sp;
    bool first_kw, comma_pending, first_item[TC_MAX_NEST + 1];
    char quote;
    prism_buf_t out;       /* scratch for converted text */
    bool str_is_key;       /* pythonic: the string being read is a dict key */
    /* What the last scan that ran into the end of the text learnt: buf[from..to) holds no end of
     * a construct of that kind begun at from (a fact about append-only text), so the next delta
     * resumes at to. Rescanning from the start each delta made a long unfinished string,
     * identifier, scalar or run of whitespace quadratic (1 MiB in small deltas: minutes). */
    struct { uint8_t kind; bool esc; size_t from, to; } scan;
};

enum { SCAN_NONE, SCAN_WS, SCAN_STR, SCAN_IDENT, SCAN_SCALAR };

/* Where a scan of kind from `from` resumes (at least `least`); *esc (may be NULL) its state. */
static size_t scan_resume(const prism_toolcall_parser_t *p, int kind, size_t from, size_t least, bool *esc)
{
    bool hit = p->scan.kind == kind && p->scan.from == from && p->scan.to > least;
    if (esc) *esc = hit && p->scan.esc;
    return hit ? p->scan.to : least;
}

static void scan_save(prism_toolcall_parser_t *p, int kind, size_t from, size_t to, bool esc)
{
    p->scan.kind = (uint8_t)kind;
    p->scan.from = from;
    p->scan.to = to;
    p->scan.esc = esc;
}

int prism_toolcall_format_parse(const char *name)
{
    if (!strcmp(name, "hermes")) return PRISM_TOOLCALL_HERMES;
    if (!strcmp(name, "pythonic") || !strcmp(name, "llama4_pythonic")) return PRISM_TOOLCALL_PYTHONIC;
    return -1;
}

/* ---- events ---- */
static void emit_content(prism_toolcall_parser_t *p, const char *s, size_t n)
{
    if (!n) return;
    prism_toolcall_event_t ev = { .kind = PRISM_TC_CONTENT, .index = -1, .text = s, .len = n };
    p->cb(p->ud, &ev);
}

static void emit_args(prism_toolcall_parser_t *p, const char *s, size_t n)
{
    if (!n) return;
    prism_toolcall_event_t ev = { .kind = PRISM_TC_ARGS, .index = p->n_calls - 1, .text = s, .len = n };
    if (!p->max_calls || ev.index < p->max_calls) p->cb(p->ud, &ev);
}

static uint64_t mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static void emit_begin(prism_toolcall_parser_t *p, const char *name, size_t n)
{
    char id[32], nm[256];
    uint64_t a = mix(p->id_seed ^ ((uint64_t)p->n_calls * 0x100000001B3ULL)), b = mix(a);
    snprintf(id, sizeof id, "call_%016llx%08x", (unsigned long long)a, (unsigned)(b >> 32));
    snprintf(nm, sizeof nm, "%.*s", (int)PRISM_MIN(n, sizeof nm - 1), name);
    prism_toolcall_event_t ev = { .kind = PRISM_TC_CALL_BEGIN, .index = p->n_calls, .id = id, .name = nm };
    p->n_calls++;
    p->call_open = true;
    if (!p->max_calls || ev.index < p->max_calls) p->cb(p->ud, &ev);
}

static void close_call(prism_toolcall_parser_t *p)
{
    p->call_open = false;
    p->n_complete++;
    p->after_call = true;
}

/* Malformed: the rest of the text, from `from`, is content. */
static void fail_to_content(prism_toolcall_parser_t *p, size_t from)
{
    p->bad = true;
    p->st = S_CONTENT_ALL;
    p->pos = from;
}

/* ---- small scanners over buf[pos..] ---- */
static inline size_t avail(const prism_toolcall_parser_t *p) { return p->buf.len - p->pos; }
static inline const char *cur(const prism_toolcall_parser_t *p) { return p->buf.data + p->pos; }
static inline bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Skips whitespace; false when the text (so far) ends first (callers may put pos back: the next
 * call from there resumes where this one stopped). */
static bool skip_ws(prism_toolcall_parser_t *p)
{
    size_t from = p->pos;
    p->pos = scan_resume(p, SCAN_WS, from, from, NULL);
    while (p->pos < p->buf.len && is_ws(p->buf.data[p->pos])) p->pos++;
    if (p->pos < p->buf.len) return true;
    scan_save(p, SCAN_WS, from, p->pos, false);
    return false;
}

/* Compares buf[pos..] with a marker: 1 full match, 0 a proper prefix (wait), -1 mismatch. */
static int match_marker(const prism_toolcall_parser_t *p, const char *m)
{
    size_t n = strlen(m), a = avail(p);
    size_t k = a < n ? a : n;
    if (memcmp(cur(p), m, k)) return -1;
    return a >= n ? 1 : 0;
}

/* End (index past the closing quote) of the JSON string starting at buf[at] == '"'; 0 = incomplete. */
static size_t json_string_end(prism_toolcall_parser_t *p, size_t at)
{
    bool esc;
    size_t i = scan_resume(p, SCAN_STR, at, at + 1, &esc);
    for (; i < p->buf.len; i++) {
        char c = p->buf.data[i];
        if (esc) esc = false;
        else if (c == '\\') esc = true;
        else if (c == '"') return i + 1;
    }
    scan_save(p, SCAN_STR, at, i, esc);
    return 0;
}

static int hexv(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Appends code point c to o as raw UTF-8, or in JSON string form (without quotes). */
static void put_utf8(prism_buf_t *o, uint32_t c)
{
    char u[4];
    prism_buf_append(o, u, (size_t)prism_utf8_encode(c, u));
}

static void put_json_char(prism_buf_t *o, uint32_t c) { prism_json_escape_cp(o, c); }

/* Decodes one JSON-string unit at buf[at] (not the closing quote) into o as raw UTF-8. Returns
 * the bytes consumed, 0 when incomplete, -1 when malformed. */
static int json_unit(const prism_toolcall_parser_t *p, size_t at, prism_buf_t *o)
{
    const char *s = p->buf.data + at;
    size_t a = p->buf.len - at;
    if (s[0] != '\\') {
        prism_buf_append(o, s, 1);
        return 1;
    }
    if (a < 2) return 0;
    switch (s[1]) {
    case '"': prism_buf_append_str(o, "\""); return 2;
    case '\\': prism_buf_append_str(o, "\\"); return 2;
    case '/': prism_buf_append_str(o, "/"); return 2;
    case 'b': prism_buf_append_str(o, "\b"); return 2;
    case 'f': prism_buf_append_str(o, "\f"); return 2;
    case 'n': prism_buf_append_str(o, "\n"); return 2;
    case 'r': prism_buf_append_str(o, "\r"); return 2;
    case 't': prism_buf_append_str(o, "\t"); return 2;
    case 'u': {
        if (a < 6) return 0;
        uint32_t c = 0;
        for (int i = 2; i < 6; i++) {
            int h = hexv(s[i]);
            if (h < 0) return -1;
            c = c * 16 + (uint32_t)h;
        }
        if (c >= 0xD800 && c < 0xDC00) {
            if (a < 12) return 0;
            if (s[6] != '\\' || s[7] != 'u') return -1;
            uint32_t lo = 0;
            for (int i = 8; i < 12; i++) {
                int h = hexv(s[i]);
                if (h < 0) return -1;
                lo = lo * 16 + (uint32_t)h;
            }
            if (lo < 0xDC00 || lo > 0xDFFF) return -1;
            put_utf8(o, 0x10000 + ((c - 0xD800) << 10) + (lo - 0xDC00));
            return 12;
        }
        if (c >= 0xDC00 && c <= 0xDFFF) return -1;
        put_utf8(o, c);
        return 6;
    }
    default: return -1;
    }
}

/* ---- hermes ---- */
static bool is_key(const prism_toolcall_parser_t *p, const char *k) { return !strcmp(p->key, k); }

static void hermes_emit_args(prism_toolcall_parser_t *p, const char *s, size_t n)
{
    if (p->have_name) emit_args(p, s, n);
    else prism_buf_append(&p->pending, s, n);
}

/* Runs until it must wait; returns false to wait. */
static bool hermes_step(prism_toolcall_parser_t *p)
{
    switch (p->st) {
    case H_CONTENT: {
        if (p->n_complete > 0 && p->after_call) {
            /* whitespace between or after calls is not content (as vLLM): decide once a
             * non-space character shows what follows */
            size_t save = p->pos;
            if (!skip_ws(p)) { if (!p->finishing) p->pos = save; return false; }
            int m = match_marker(p, HERMES_OPEN);
            if (m == 0 && !p->finishing) { p->pos = save; return false; }
            if (m != 1) p->pos = save;  /* real content: keep its leading whitespace */
            p->after_call = false;
        }
        const char *s = cur(p);
        size_t a = avail(p);
        const char *hit = a ? memmem(s, a, HERMES_OPEN, sizeof HERMES_OPEN - 1) : NULL;
        if (hit) {
            emit_content(p, s, (size_t)(hit - s));
            p->pos += (size_t)(hit - s) + sizeof HERMES_OPEN - 1;
            p->st = H_OBJ_START;
            p->have_name = p->have_args = false;
            prism_buf_reset(&p->pending);
            return true;
        }
        /* hold back a tail that may start the marker */
        size_t hold = 0;
        if (!p->finishing)
            for (size_t k = PRISM_MIN(a, sizeof HERMES_OPEN - 2); k > 0; k--)
                if (!memcmp(s + a - k, HERMES_OPEN, k)) { hold = k; break; }
        emit_content(p, s, a - hold);
        p->pos += a - hold;
        return false;
    }
    case H_OBJ_START:
        if (!skip_ws(p)) return false;
        if (*cur(p) != '{') { fail_to_content(p, p->pos); return true; }
        p->pos++;
        p->st = H_KEY;
        return true;
    case H_KEY: {
        if (!skip_ws(p)) return false;
        char c = *cur(p);
        if (c == '}') { p->pos++; p->st = H_CLOSE; return true; }
        if (c != '"') { fail_to_content(p, p->pos); return true; }
        size_t end = json_string_end(p, p->pos);
        if (!end) return false;
        size_t n = end - p->pos - 2;
        snprintf(p->key, sizeof p->key, "%.*s", (int)PRISM_MIN(n, sizeof p->key - 1), cur(p) + 1);
        if (n >= sizeof p->key) p->key[0] = '?';  /* a long key is never one we use */
        p->pos = end;
        p->st = H_COLON;
        return true;
    }
    case H_COLON:
        if (!skip_ws(p)) return false;
        if (*cur(p) != ':') { fail_to_content(p, p->pos); return true; }
        p->pos++;
        p->st = H_VALUE;
        return true;
    case H_VALUE: {
        if (!skip_ws(p)) return false;
        char c = *cur(p);
        if (is_key(p, "name") && !p->have_name) {
            if (c != '"') { fail_to_content(p, p->pos); return true; }
            p->st = H_NAME;
        } else if (is_key(p, "arguments") && !p->have_args) {
            p->have_args = true;
            if (c == '"') { p->pos++; p->st = H_ARGS_STR; }
            else { p->depth = 0; p->in_str = p->esc = p->val_started = false; p->st = H_ARGS_RAW; }
        } else {
            p->depth = 0; p->in_str = p->esc = p->val_started = false;
            p->st = H_SKIP_VALUE;
        }
        return true;
    }
    case H_NAME: {
        size_t end = json_string_end(p, p->pos);
        if (!end) return false;
        json_t *j = json_loadb(cur(p), end - p->pos, JSON_DECODE_ANY, NULL);
        if (!j || !json_is_string(j) || json_string_length(j) == 0) {
            json_decref(j);
            fail_to_content(p, p->pos);
            return true;
        }
        emit_begin(p, json_string_value(j), json_string_length(j));
        json_decref(j);
        p->have_name = true;
        p->pos = end;
        if (p->pending.len) emit_args(p, p->pending.data, p->pending.len);
        prism_buf_reset(&p->pending);
        p->st = H_AFTER_VALUE;
        return true;
    }
    case H_ARGS_RAW:
    case H_SKIP_VALUE: {
        /* a JSON value, scanned for its end; arguments are passed through as written */
        bool emit = p->st == H_ARGS_RAW;
        size_t start = p->pos;
        bool done = false;
        while (p->pos < p->buf.len && !done) {
            char c = p->buf.data[p->pos];
            if (p->in_str) {
                if (p->esc) p->esc = false;
                else if (c == '\\') p->esc = true;
                else if (c == '"') { p->in_str = false; if (p->depth == 0) done = true; }
                p->pos++;
                continue;
            }
            if (c == '"') { p->in_str = true; p->val_started = true; p->pos++; continue; }
            if (c == '{' || c == '[') { p->depth++; p->val_started = true; p->pos++; continue; }
            if (c == '}' || c == ']') {
                if (p->depth == 0) { done = true; break; }  /* a scalar ended by the object's close */
                p->depth--;
                p->pos++;
                if (p->depth == 0) done = true;
                continue;
            }
            if (p->depth == 0 && (c == ',' || is_ws(c)) && p->val_started) { done = true; break; }
            if (p->depth == 0 && (c == ',' || is_ws(c))) { fail_to_content(p, p->pos); return true; }
            p->val_started = true;
            p->pos++;
        }
        if (emit) hermes_emit_args(p, p->buf.data + start, p->pos - start);
        if (!done) {
            if (p->finishing) { fail_to_content(p, p->pos); return true; }
            return false;
        }
        p->st = H_AFTER_VALUE;
        return true;
    }
    case H_ARGS_STR: {
        /* stringified arguments: decode the string as it comes */
        prism_buf_reset(&p->out);
        while (p->pos < p->buf.len) {
            if (p->buf.data[p->pos] == '"') {
                hermes_emit_args(p, p->out.data, p->out.len);
                p->pos++;
                p->st = H_AFTER_VALUE;
                return true;
            }
            int k = json_unit(p, p->pos, &p->out);
            if (k < 0) { hermes_emit_args(p, p->out.data, p->out.len); fail_to_content(p, p->pos); return true; }
            if (k == 0) break;
            p->pos += (size_t)k;
        }
        hermes_emit_args(p, p->out.data, p->out.len);
        if (p->finishing) { fail_to_content(p, p->pos); return true; }
        return false;
    }
    case H_AFTER_VALUE: {
        if (!skip_ws(p)) return false;
        char c = *cur(p);
        p->pos++;
        if (c == ',') p->st = H_KEY;
        else if (c == '}') p->st = H_CLOSE;
        else fail_to_content(p, p->pos - 1);
        return true;
    }
    case H_CLOSE: {
        if (!p->have_name) { fail_to_content(p, p->pos); return true; }
        if (!p->have_args) {
            emit_args(p, "{}", 2);
            p->have_args = true;
        }
        size_t save = p->pos;
        if (!skip_ws(p)) {
            if (p->finishing) { close_call(p); p->st = H_CONTENT; return false; }  /* unclosed last call */
            p->pos = save;
            return false;
        }
        int m = match_marker(p, HERMES_CLOSE);
        if (m == 0) {
            if (p->finishing) { fail_to_content(p, p->pos); return true; }
            p->pos = save;
            return false;
        }
        if (m < 0) { fail_to_content(p, p->pos); return true; }
        p->pos += sizeof HERMES_CLOSE - 1;
        close_call(p);
        p->st = H_CONTENT;
        return true;
    }
    default:
        PRISM_FATAL("hermes parser in state %d", p->st);
    }
}

/* ---- pythonic ---- */
static bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_ident(char c) { return is_ident_start(c) || (c >= '0' && c <= '9') || c == '.' || c == '-'; }

/* Identifier at pos; returns its length, 0 if incomplete (no delimiter yet), -1 if none or past
 * 200 characters (known as soon as the 201st arrives). */
static int ident_len(prism_toolcall_parser_t *p)
{
    if (!is_ident_start(*cur(p))) return -1;
    size_t i = scan_resume(p, SCAN_IDENT, p->pos, p->pos + 1, NULL) - p->pos;
    while (i < avail(p) && i <= 200 && is_ident(cur(p)[i])) i++;
    if (i > 200) return -1;
    if (i == avail(p) && !p->finishing) {
        scan_save(p, SCAN_IDENT, p->pos, p->pos + i, false);
        return 0;
    }
    return (int)i;
}

/* After a value at nesting sp: what comes next. */
static void py_value_done(prism_toolcall_parser_t *p) { p->st = P_AFTER_VALUE; }

/* One Python string unit inside quotes at pos; 0 incomplete, -1 malformed, else consumed. */
static int py_unit(prism_toolcall_parser_t *p, prism_buf_t *o)
{
    const char *s = cur(p);
    size_t a = avail(p);
    if (s[0] == '\n') return -1;
    if (s[0] != '\\') {
        /* one UTF-8 code point, copied through JSON escaping */
        uint8_t c = (uint8_t)s[0];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : -1;
        if (len < 0) return -1;
        if ((size_t)len > a) return 0;
        if (len == 1) put_json_char(o, c);
        else prism_buf_append(o, s, (size_t)len);
        return len;
    }
    if (a < 2) return 0;
    int n = 0;
    uint32_t c;
    switch (s[1]) {
    case '\\': c = '\\'; n = 2; break;
    case '\'': c = '\''; n = 2; break;
    case '"': c = '"'; n = 2; break;
    case 'n': c = '\n'; n = 2; break;
    case 't': c = '\t'; n = 2; break;
    case 'r': c = '\r'; n = 2; break;
    case 'b': c = '\b'; n = 2; break;
    case 'f': c = '\f'; n = 2; break;
    case 'v': c = '\v'; n = 2; break;
    case 'a': c = 7; n = 2; break;
    case '\n': return 2;  /* line continuation */
    case 'x': case 'u': case 'U': {
        int d = s[1] == 'x' ? 2 : s[1] == 'u' ? 4 : 8;
        if (a < (size_t)(2 + d)) return 0;
        c = 0;
        for (int i = 0; i < d; i++) {
            int h = hexv(s[2 + i]);
            if (h < 0) return -1;
            c = c * 16 + (uint32_t)h;
        }
        if (c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return -1;
        n = 2 + d;
        break;
    }
    default:
        if (s[1] >= '0' && s[1] <= '7') {
            c = 0;
            n = 1;
            while (n < 4 && (size_t)n < a && s[n] >= '0' && s[n] <= '7') { c = c * 8 + (uint32_t)(s[n] - '0'); n++; }
            if ((size_t)n == a && n < 4 && !p->finishing) return 0;
            break;
        }
        /* unknown escapes keep the backslash, as Python does */
        put_json_char(o, '\\');
        return 1;
    }
    put_json_char(o, c);
    return n;
}

static bool py_step(prism_toolcall_parser_t *p)
{
    switch (p->st) {
    case P_START: {
        size_t save = p->pos;
        if (!skip_ws(p)) { p->pos = save; if (p->finishing) { p->st = S_CONTENT_ALL; return true; } return false; }
        int m = match_marker(p, PY_START);
        if (m == 0 && !p->finishing) { p->pos = save; return false; }
        if (m == 1) { p->pos += sizeof PY_START - 1; return true; }
        if (*cur(p) != '[') { p->pos = 0; p->st = S_CONTENT_ALL; return true; }
        p->pos++;
        p->st = P_CALL;
        p->comma_pending = false;
        return true;
    }
    case P_CALL: {
        if (!skip_ws(p)) return false;
        if (*cur(p) == ']' && p->comma_pending) { p->pos++; p->st = P_END; return true; }
        int n = ident_len(p);
        if (n == 0) return false;
        if (n < 0) { fail_to_content(p, p->pos); return true; }
        size_t save = p->pos;
        p->pos += (size_t)n;
        if (!skip_ws(p)) { p->pos = save; if (p->finishing) fail_to_content(p, save); return p->finishing; }
        if (*cur(p) != '(') { fail_to_content(p, save); return true; }
        p->pos++;
        emit_begin(p, p->buf.data + save, (size_t)n);
        emit_args(p, "{", 1);
        p->first_kw = true;
        p->comma_pending = false;
        p->st = P_KW;
        return true;
    }
    case P_KW: {
        if (!skip_ws(p)) return false;
        if (*cur(p) == ')' && (p->first_kw || p->comma_pending)) {
            p->pos++;
            emit_args(p, "}", 1);
            close_call(p);
            p->comma_pending = false;
            p->st = P_AFTER_CALL;
            return true;
        }
        if (!p->first_kw && !p->comma_pending) { fail_to_content(p, p->pos); return true; }
        int n = ident_len(p);
        if (n == 0) return false;
        if (n < 0) { fail_to_content(p, p->pos); return true; }
        prism_buf_reset(&p->out);
        if (!p->first_kw) prism_buf_append_str(&p->out, ", ");
        prism_buf_append_str(&p->out, "\"");
        for (int i = 0; i < n; i++) put_json_char(&p->out, (uint8_t)cur(p)[i]);
        prism_buf_append_str(&p->out, "\": ");
        p->pos += (size_t)n;
        p->first_kw = false;
        p->comma_pending = false;
        p->st = P_EQ;
        /* the key is emitted with the '=' so a malformed kwarg emits nothing */
        return true;
    }
    case P_EQ:
        if (!skip_ws(p)) return false;
        if (*cur(p) != '=') { fail_to_content(p, p->pos); return true; }
        p->pos++;
        emit_args(p, p->out.data, p->out.len);
        p->sp = 0;
        p->first_item[0] = true;
        p->st = P_VALUE;
        return true;
    case P_VALUE: {
        if (!skip_ws(p)) return false;
        char c = *cur(p);
        if (c == ']' || c == ')' || c == '}') {
            /* a container closing right after its opener or after a trailing comma */
            if (p->sp > 0 && p->stack[p->sp - 1] == c && p->comma_pending) {
                p->pos++;
                p->sp--;
                emit_args(p, c == '}' ? "}" : "]", 1);
                p->comma_pending = false;
                py_value_done(p);
                return true;
            }
            fail_to_content(p, p->pos);
            return true;
        }
        /* a value starts: separator first unless it is the first in its container */
        const char *sep = p->sp > 0 && !p->first_item[p->sp] ? ", " : "";
        if (c == '\'' || c == '"') {
            if (avail(p) < 3 && !p->finishing) return false;
            if (avail(p) >= 3 && cur(p)[1] == c && cur(p)[2] == c) { fail_to_content(p, p->pos); return true; }
            emit_args(p, sep, strlen(sep));
            if (p->sp > 0) p->first_item[p->sp] = false;
            p->comma_pending = false;
            p->quote = c;
            p->pos++;
            emit_args(p, "\"", 1);
            p->st = P_STRING;
            return true;
        }
        if (c == '[' || c == '(' || c == '{') {
            if (p->sp >= TC_MAX_NEST) { fail_to_content(p, p->pos); return true; }
            emit_args(p, sep, strlen(sep));
            if (p->sp > 0) p->first_item[p->sp] = false;
            p->stack[p->sp++] = c == '[' ? ']' : c == '(' ? ')' : '}';
            p->first_item[p->sp] = true;
            p->comma_pending = true;  /* lets the container close at once */
            p->pos++;
            emit_args(p, c == '{' ? "{" : "[", 1);
            p->st = c == '{' ? P_DICT_KEY : P_VALUE;
            return true;
        }
        /* scalars need their delimiter to be seen */
        size_t a = avail(p), i = scan_resume(p, SCAN_SCALAR, p->pos, p->pos, NULL) - p->pos;
        while (i < a && !is_ws(cur(p)[i]) && !strchr(",)]}:", cur(p)[i])) i++;
        if (i == a && !p->finishing) {
            scan_save(p, SCAN_SCALAR, p->pos, p->pos + i, false);
            return false;
        }
        const char *t = cur(p);
        prism_buf_reset(&p->out);
        prism_buf_append_str(&p->out, sep);
        if (i == 4 && !memcmp(t, "True", 4)) prism_buf_append_str(&p->out, "true");
        else if (i == 5 && !memcmp(t, "False", 5)) prism_buf_append_str(&p->out, "false");
        else if (i == 4 && !memcmp(t, "None", 4)) prism_buf_append_str(&p->out, "null");
        else {
            /* -?digits(.digits*)?([eE][+-]?digits)? ; no leading zeros, as Python 3 and JSON */
            size_t k = 0;
            if (k < i && t[k] == '-') k++;
            size_t d0 = k;
            while (k < i && t[k] >= '0' && t[k] <= '9') k++;
            bool ok = k > d0 && !(t[d0] == '0' && k - d0 > 1);
            prism_buf_append(&p->out, t, k);
            if (ok && k < i && t[k] == '.') {
                size_t f0 = ++k;
                while (k < i && t[k] >= '0' && t[k] <= '9') k++;
                prism_buf_append(&p->out, t + f0 - 1, k - f0 + 1);
                if (k == f0) prism_buf_append_str(&p->out, "0");
            }
            if (ok && k < i && (t[k] == 'e' || t[k] == 'E')) {
                size_t e0 = k++;
                if (k < i && (t[k] == '+' || t[k] == '-')) k++;
                size_t d1 = k;
                while (k < i && t[k] >= '0' && t[k] <= '9') k++;
                ok = k > d1;
                prism_buf_append(&p->out, t + e0, k - e0);
            }
            if (!ok || k != i) { fail_to_content(p, p->pos); return true; }
        }
        p->pos += i;
        emit_args(p, p->out.data, p->out.len);
        if (p->sp > 0) p->first_item[p->sp] = false;
        p->comma_pending = false;
        py_value_done(p);
        return true;
    }
    case P_STRING: {
        prism_buf_reset(&p->out);
        while (p->pos < p->buf.len) {
            if (*cur(p) == p->quote) {
                prism_buf_append_str(&p->out, "\"");
                emit_args(p, p->out.data, p->out.len);
                p->pos++;
                if (p->sp > 0) p->first_item[p->sp] = false;
                /* a string that is a dict key is followed by ':' */
                if (p->str_is_key) { p->str_is_key = false; p->st = P_DICT_COLON; }
                else py_value_done(p);
                return true;
            }
            int k = py_unit(p, &p->out);
            if (k < 0) { emit_args(p, p->out.data, p->out.len); fail_to_content(p, p->pos); return true; }
            if (k == 0) break;
            p->pos += (size_t)k;
        }
        emit_args(p, p->out.data, p->out.len);
        if (p->finishing) { fail_to_content(p, p->pos); return true; }
        return false;
    }
    case P_DICT_KEY: {
        if (!skip_ws(p)) return false;
        char c = *cur(p);
        if (c == '}' && (p->first_item[p->sp] || p->comma_pending)) {
            p->pos++;
            p->sp--;
            emit_args(p, "}", 1);
            p->comma_pending = false;
            py_value_done(p);
            return true;
        }
        if (c != '\'' && c != '"') { fail_to_content(p, p->pos); return true; }
        if (!p->first_item[p->sp]) emit_args(p, ", ", 2);
        p->comma_pending = false;
        p->quote = c;
        p->str_is_key = true;
        p->pos++;
        emit_args(p, "\"", 1);
        p->st = P_STRING;
        return true;
    }
    case P_DICT_COLON:
        if (!skip_ws(p)) return false;
        if (*cur(p) != ':') { fail_to_content(p, p->pos); return true; }
        p->pos++;
        emit_args(p, ": ", 2);
        p->first_item[p->sp] = true;  /* the value: no separator before it */
        p->comma_pending = false;
        p->st = P_VALUE;
        return true;
    case P_AFTER_VALUE: {
        if (!skip_ws(p)) return false;
        char c = *cur(p);
        if (p->sp == 0) {
            /* a keyword argument's value is complete */
            if (c == ',') { p->pos++; p->comma_pending = true; p->st = P_KW; return true; }
            if (c == ')') { p->st = P_KW; p->comma_pending = true; return true; }
            fail_to_content(p, p->pos);
            return true;
        }
        char closer = p->stack[p->sp - 1];
        if (c == ',') {
            p->pos++;
            p->comma_pending = true;
            if (closer == '}') { p->first_item[p->sp] = false; p->st = P_DICT_KEY; }
            else p->st = P_VALUE;
            return true;
        }
        if (c == closer) {
            p->pos++;
            p->sp--;
            emit_args(p, closer == '}' ? "}" : "]", 1);
            p->comma_pending = false;
            return true;  /* still P_AFTER_VALUE, one level up */
        }
        fail_to_content(p, p->pos);
        return true;
    }
    case P_AFTER_CALL: {
        if (!skip_ws(p)) return false;
        char c = *cur(p);
        p->pos++;
        if (c == ',') { p->comma_pending = true; p->st = P_CALL; }
        else if (c == ']') p->st = P_END;
        else fail_to_content(p, p->pos - 1);
        return true;
    }
    case P_END: {
        size_t save = p->pos;
        if (!skip_ws(p)) return false;
        int m = match_marker(p, PY_END);
        if (m == 1) { p->pos += sizeof PY_END - 1; return true; }
        if (m == 0 && !p->finishing) { p->pos = save; return false; }
        p->st = S_CONTENT_ALL;  /* text after the call list */
        return true;
    }
    default:
        PRISM_FATAL("pythonic parser in state %d", p->st);
    }
}

static void run(prism_toolcall_parser_t *p)
{
    for (;;) {
        if (p->st == S_CONTENT_ALL) {
            emit_content(p, cur(p), avail(p));
            p->pos = p->buf.len;
            return;
        }
        bool more = p->fmt == PRISM_TOOLCALL_HERMES ? hermes_step(p) : py_step(p);
        if (!more) return;
    }
}

int prism_toolcall_parser_create(prism_toolcall_format_t fmt, uint64_t id_seed, size_t max_bytes, int max_calls,
                                 prism_toolcall_cb cb, void *ud, prism_toolcall_parser_t **out)
{
    *out = NULL;
    if (fmt != PRISM_TOOLCALL_HERMES && fmt != PRISM_TOOLCALL_PYTHONIC) return PRISM_EINVAL;
    if (max_calls < 0) return PRISM_EINVAL;
    prism_toolcall_parser_t *p = prism_calloc(1, sizeof *p);
    if (!p) return PRISM_ENOMEM;
    p->fmt = fmt;
    p->id_seed = id_seed;
    p->max_bytes = max_bytes ? max_bytes : TC_DEFAULT_MAX;
    p->max_calls = max_calls;
    p->cb = cb;
    p->ud = ud;
    p->st = fmt == PRISM_TOOLCALL_HERMES ? H_CONTENT : P_START;
    *out = p;
    return PRISM_OK;
}

void prism_toolcall_parser_free(prism_toolcall_parser_t *p)
{
    if (!p) return;
    prism_buf_free(&p->buf);
    prism_buf_free(&p->pending);
    prism_buf_free(&p->out);
    prism_free(p);
}

int prism_toolcall_parser_feed(prism_toolcall_parser_t *p, const char *text, size_t len)
{
    if (p->finished) return PRISM_EINVAL;
    if (p->buf.len + len > p->max_bytes) return PRISM_ELIMIT;
    if (len && prism_buf_append(&p->buf, text, len) < 0) return PRISM_ENOMEM;
    run(p);
    return PRISM_OK;
}

int prism_toolcall_parser_finish(prism_toolcall_parser_t *p)
{
    if (p->finished) return PRISM_OK;
    p->finishing = true;
    run(p);
    if (p->call_open) p->bad = true;
    p->finished = true;
    return PRISM_OK;
}

int prism_toolcall_parser_n_calls(const prism_toolcall_parser_t *p) { return p->n_calls; }
bool prism_toolcall_parser_ok(const prism_toolcall_parser_t *p) { return !p->bad && !p->call_open; }

/* ---- whole text ---- */
static void collect(void *ud, const prism_toolcall_event_t *ev)
{
    prism_toolcall_result_t *r = ud;
    switch (ev->kind) {
    case PRISM_TC_CONTENT:
        prism_buf_append(&r->content, ev->text, ev->len);
        break;
    case PRISM_TC_CALL_BEGIN: {
        prism_toolcall_t *c = prism_realloc(r->calls, (r->n_calls + 1) * sizeof *c);
        if (!c) return;
        r->calls = c;
        memset(&c[r->n_calls], 0, sizeof *c);
        snprintf(c[r->n_calls].id, sizeof c[r->n_calls].id, "%s", ev->id);
        c[r->n_calls].name = prism_strdup(ev->name);
        r->n_calls++;
        break;
    }
    case PRISM_TC_ARGS:
        if (ev->index >= 0 && (size_t)ev->index < r->n_calls)
            prism_buf_append(&r->calls[ev->index].arguments, ev->text, ev->len);
        break;
    }
}

int prism_toolcall_parse(prism_toolcall_format_t fmt, const char *text, size_t len, uint64_t id_seed, int max_calls,
                         prism_toolcall_result_t *out)
{
    memset(out, 0, sizeof *out);
    prism_toolcall_parser_t *p;
    int rc = prism_toolcall_parser_create(fmt, id_seed, len + 1, max_calls, collect, out, &p);
    if (rc < 0) return rc;
    rc = prism_toolcall_parser_feed(p, text, len);
    if (rc == PRISM_OK) rc = prism_toolcall_parser_finish(p);
    /* calls closed before the end are complete; an open one is not */
    for (size_t i = 0; i < out->n_calls; i++) out->calls[i].complete = (int)i < p->n_complete;
    out->ok = prism_toolcall_parser_ok(p);
    prism_toolcall_parser_free(p);
    return rc;
}

void prism_toolcall_result_free(prism_toolcall_result_t *r)
{
    for (size_t i = 0; i < r->n_calls; i++) {
        prism_free(r->calls[i].name);
        prism_buf_free(&r->calls[i].arguments);
    }
    prism_free(r->calls);
    prism_buf_free(&r->content);
    memset(r, 0, sizeof *r);
}
