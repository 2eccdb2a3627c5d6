/* tokenizer: HF tokenizer.json loader, encoder, decoder and streaming detokenizer.
 *
 * Produces ids identical to HF `tokenizers` for the component set used by Llama-2/3, Qwen2/3 and
 * LLaVA tokenizers: BPE model (byte-level or SentencePiece-style with byte_fallback, merges in
 * "a b" or ["a","b"] form, ignore_merges), added/special tokens (single_word, lstrip, rstrip,
 * normalized), normalizers NFC/NFD/Prepend/Replace/Strip/Sequence, pre-tokenizers
 * ByteLevel/Split/Metaspace/Digits/WhitespaceSplit/Sequence, post-processors
 * TemplateProcessing/ByteLevel/RobertaProcessing/BertProcessing/Sequence and decoders
 * ByteLevel/Metaspace/ByteFallback/Fuse/Strip/Replace/Sequence. Anything else fails to load
 * with PRISM_ENOTSUP naming the component.
 *
 * A loaded tokenizer is immutable: encode/decode may run concurrently from many threads.
 *
 * Usage:
 *   prism_tokenizer_t *tok; char err[256];
 *   if (prism_tokenizer_load("tokenizer.json", &tok, err, sizeof err) < 0) fail(err);
 *   int32_t *ids = NULL; size_t n = 0, cap = 0;
 *   prism_tokenizer_encode(tok, text, strlen(text), true, &ids, &n, &cap);
 *   prism_buf_t s = {0}; prism_tokenizer_decode(tok, ids, n, true, &s);
 *   // streaming: prism_detok_init(&d, tok, true); per id: prism_detok_push(&d, id, &delta);
 *   prism_free(ids); prism_buf_free(&s); prism_tokenizer_free(tok);
 */
#ifndef PRISM_TOKENIZER_H
#define PRISM_TOKENIZER_H

#include "core/core.h"

typedef struct prism_tokenizer prism_tokenizer_t;

/* Loading fails with PRISM_ELIMIT for files over 64 MiB, PRISM_ECORRUPT for malformed JSON or
 * contents, PRISM_ENOTSUP for unsupported components; err receives a message. */
int  prism_tokenizer_load(const char *tokenizer_json_path, prism_tokenizer_t **out, char *err, size_t errlen);
int  prism_tokenizer_load_from_memory(const char *json, size_t len, prism_tokenizer_t **out, char *err,
                                      size_t errlen);
void prism_tokenizer_free(prism_tokenizer_t *t);

/* ids appended to *ids (prism_realloc-grown, *cap tracks capacity); add_special applies the
 * post-processor. text must be valid UTF-8 (PRISM_EINVAL otherwise) and at most 8 MiB
 * (PRISM_ELIMIT). On failure *n is left unchanged. */
int  prism_tokenizer_encode(const prism_tokenizer_t *t, const char *text, size_t len, bool add_special,
                            int32_t **ids, size_t *n, size_t *cap);
/* Appends HF decode(ids, skip_special_tokens=skip_special) to out. Unknown ids are ignored. */
int  prism_tokenizer_decode(const prism_tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                            prism_buf_t *out);
int32_t prism_tokenizer_token_to_id(const prism_tokenizer_t *t, const char *token);  /* -1 if absent */
const char *prism_tokenizer_id_to_token(const prism_tokenizer_t *t, int32_t id);    /* NULL if out of range */
/* Raw bytes the token contributes to decoded text (byte-level / byte-fallback resolved, the
 * Metaspace / Replace marker shown as a space): for OpenAI logprobs "bytes". Appends to out. */
int  prism_tokenizer_token_bytes(const prism_tokenizer_t *t, int32_t id, prism_buf_t *out);
size_t prism_tokenizer_vocab_size(const prism_tokenizer_t *t);  /* including added tokens: max id + 1 */
bool prism_tokenizer_is_special(const prism_tokenizer_t *t, int32_t id);

/* Incremental detokenizer for streaming (vLLM prefix_offset/read_offset technique): the
 * concatenation of all deltas equals prism_tokenizer_decode(all ids); a delta never ends in a
 * partial UTF-8 sequence. Memory stays bounded: ids before prefix_offset are dropped.
 * One exception, shared with vLLM: HF's ByteFallback decoder turns a whole run of <0xNN> tokens
 * into U+FFFDs when the run as a whole is invalid UTF-8, so a stray byte token arriving right
 * after a completed multi-byte char changes how decode() renders that char after it was already
 * streamed. Text made by encoding valid UTF-8 never does this.
 * Work per id is bounded: ids that decode() drops (outside the vocabulary, skipped specials) never
 * enter the window, and a run of ids that adds no text moves the window on after
 * PRISM_TOK_DETOK_MAX_PENDING ids (a decoder that lets such a run change later text is then
 * streamed as if the run had ended there). */
typedef struct {
    const prism_tokenizer_t *tok;
    bool skip_special;
    int32_t *ids;            /* [cap] ids from the current prefix_offset on */
    size_t n, cap;
    size_t prefix_offset;    /* into ids: start of the context window (always 0 after compaction) */
    size_t read_offset;      /* into ids: first id whose text has not been emitted */
    prism_buf_t prefix_text; /* scratch: decode(ids[prefix_offset:read_offset]) */
    prism_buf_t new_text;    /* scratch: decode(ids[prefix_offset:]) */
    uint64_t decoded_ids;    /* ids run through the decoder so far: linear in the ids pushed */
} prism_detok_t;

void prism_detok_init(prism_detok_t *d, const prism_tokenizer_t *t, bool skip_special);
int  prism_detok_push(prism_detok_t *d, int32_t id, prism_buf_t *delta);  /* appends new text to delta */
int  prism_detok_flush(prism_detok_t *d, prism_buf_t *delta);             /* at end of stream */
void prism_detok_free(prism_detok_t *d);

#endif
