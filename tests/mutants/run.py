#!/usr/bin/env python3
"""Mutation check of the guarantees in docs/TESTING.md: each mutant breaks one guarantee on purpose,
and the test docs/TESTING.md names for that guarantee must fail on it (a test that passes on a
broken product proves nothing).

For every mutant (MUTANTS below) it applies the edit to a scratch worktree of the current commit,
rebuilds there (ccache; CUDA off), runs the named test and expects it to fail; with --baseline it
first runs each named test on the unmutated tree, where it must pass. The scratch tree and its build
stay under --work (default BUILD/mutants) so later runs rebuild only what a mutant touches.

  python3 tests/mutants/run.py                      # every mutant
  python3 tests/mutants/run.py decode-abort-ignored router-ignores-seed --baseline
  python3 tests/mutants/run.py --list
  python3 tests/mutants/run.py --clean              # the scratch worktree (a registered git worktree) goes

Exit status 0 when every mutant was caught. One line per mutant: caught / MISSED, and the time.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

IT = "python3 tests/integration/"
# name: (what it breaks, [(file, text, replacement)], the test that must fail, build targets)
MUTANTS = {
    "decode-abort-ignored": (
        "the decode worker logs an abort and keeps generating (issue 27)",
        [("decode_worker/main.c",
          "            if (!s->cancel) d->aborted++;\n"
          "            if (s->in_step || s->finishing || s->preempt) s->cancel = true;   /* the device still writes its blocks */\n"
          "            else seq_release(d, s);\n", ""),
         ("decode_worker/main.c",
          "    if (!prism_worker_aborted(&d->w, s->seq.rid, s->seq.router_id, &waited)) return false;",
          "    if (!prism_worker_aborted(&d->w, s->seq.rid, s->seq.router_id, &waited) || 1) return false;")],
        IT + "test_streaming.py test_client_disconnect_aborts_generation", ["decode_worker"]),
    "prefill-no-midprompt-stop": (
        "the prefill worker logs and counts the abort of the prompt it runs and runs it to its end",
        [("prefill_worker/main.c",
          "    x->dropped = true;\n    return true;\n}", "    return false;\n}"),
         ("prefill_worker/main.c", "    release_req(p, r);\n    p->cancelled++;\n}", "    p->cancelled++;\n}"),
         ("prefill_worker/main.c", "            drop_request(p, m->env->request_id, router);\n",
          "            if (!(r && r->in_model)) drop_request(p, m->env->request_id, router);\n")],
        IT + "test_streaming.py test_client_disconnect_stops_prefill_mid_prompt", ["prefill_worker"]),
    "encoder-libc-strdup": (
        "a libc strdup / free per Encode in worker code (the counter sees only prism_malloc)",
        [("encoder_worker/main.c",
          "static void on_encode(encoder_t *e, prism_msg_t *m)\n{\n",
          "#include <stdlib.h>\n#include <string.h>\n"
          "static void on_encode(encoder_t *e, prism_msg_t *m)\n{\n"
          "    char *copy = strdup(m->env->router_id ? m->env->router_id : \"\");\n"
          "    if (copy && copy[0] == 1) e->failed++;\n    free(copy);\n")],
        "ctest --test-dir $BUILD -R '^test_alloc_calls$' --output-on-failure", ["encoder_worker"]),
    "plan-without-prefill-kv": (
        "the prefill worker's memory plan leaves its KV cache out (one block of it counted)",
        [("prefill_worker/main.c",
          "    prism_mem_plan_add(pl, \"kv-cache\", (size_t)s->cap.kv_blocks * kv_block_bytes(p), PRISM_MEM_LIBRARY);",
          "    prism_mem_plan_add(pl, \"kv-cache\", kv_block_bytes(p), PRISM_MEM_LIBRARY);")],
        IT + "test_limits.py test_every_worker_within_its_plan_under_load", ["prefill_worker"]),
    "encoder-drops-on-full-pool": (
        "a full prefill pool fails the image instead of making the encoder wait",
        [("encoder_worker/main.c",
          "            if (rc == PRISM_EAGAIN) {   /* the prefill's pool is full",
          "            if (rc == PRISM_EAGAIN && 0) {   /* the prefill's pool is full")],
        IT + "test_limits.py test_backpressure_and_flat_allocations", ["encoder_worker"]),
    "encoder-interleaves-images": (
        "another image's first piece goes to a prefill between two pieces of an image (its pool's credit taken)",
        [("encoder_worker/main.c", "                if (!wait) full[n_full++] = j->prefill_endpoint;",
          "                if (!wait && 0) full[n_full++] = j->prefill_endpoint;")],
        IT + "test_qwen.py test_full_pool_waits", ["encoder_worker"]),
    "prefill-pool-need-unchecked": (
        "a prompt whose images need more than the prefill's embedding pool is admitted (it waits for ever)",
        [("prefill_worker/main.c", "    if (need > p->n_pages) {", "    if (need > p->n_pages && 0) {")],
        IT + "test_admission.py test_prompt_larger_than_pool_refused", ["prefill_worker"]),
    "prefill-pool-stall-kept": (
        "a prefill pool full of prompts waiting for images that cannot come is never broken",
        [("prefill_worker/main.c", "    if (now - p->stall_since < PRISM_POOL_STALL_S) return;",
          "    if (now - p->stall_since < PRISM_POOL_STALL_S || 1) return;")],
        IT + "test_admission.py test_full_pool_stall_broken", ["prefill_worker"]),
    "embed-cache-ignores-pins": (
        "a cache miss overwrites an entry a hit of the same batch still reads",
        [("encoder_worker/embed_cache.c", "        } else if (!c->pins[i]) {", "        } else if (1) {"),
         ("encoder_worker/embed_cache.c",
          "if (c->used[i] && !c->pins[i] && (victim < 0 || c->stamp[i] < c->stamp[victim])) victim = i;",
          "if (c->used[i] && (victim < 0 || c->stamp[i] < c->stamp[victim])) victim = i;")],
        IT + "test_encoder.py test_cache_hit_keeps_its_own_embeddings", ["encoder_worker"]),
    "router-ignores-seed": (
        "the router drops the client's seed (the sampler draws its own)",
        [("router/sched.c", "    sp->has_seed = o->has_seed;", "    sp->has_seed = false;")],
        IT + "test_e2e.py test_seeded_sampling_reproducible", ["router"]),
    "router-constant-seed": (
        "the router sends one seed whatever the client asked",
        [("router/sched.c", "    sp->seed = (uint64_t)o->seed;", "    sp->seed = 1;")],
        IT + "test_e2e.py test_seeded_sampling_reproducible", ["router"]),
    "api-key-prefix": (
        "the API key compared without its length (an empty or partial Bearer token passes)",
        [("common/core/core.c", "    uint8_t diff = (uint8_t)(presented_len != secret_len);", "    uint8_t diff = 0;")],
        IT + "test_admission.py test_api_key", ["router"]),
    "paused-upload-408": (
        "a paused upload judged from its headers (pauses taken out, the way back counted): 408",
        [("router/http_server.c",
          "            c->t_rate = uv_now(c->srv->loop);\n            c->raw_rate = c->req ? c->req->body_raw : 0;",
          "            c->t_rate += uv_now(c->srv->loop) - c->t_paused;")],
        IT + "test_admission.py test_paused_uploads_are_not_slow_clients", ["router"]),
    "router-no-budget": (
        "the router's bounds ignore --mem-budget (the old defaults: 1 GiB of bodies, 1 GiB of images)",
        [("router/plan.c", "    bool budget = in->budget > 0;", "    bool budget = false;")],
        IT + "test_limits.py test_router_within_its_budget_under_a_burst", ["router"]),
    "router-parse-bound-ignored": (
        "generation requests parsed under the scan's 96 MiB default, not the plan's parse bound",
        [("router/requests.c", "                                    .max_parse_bytes = r->max_parse_bytes};",
          "                                    };")],
        IT + "test_limits.py test_router_within_its_budget_under_a_burst", ["router"]),
    "tokenize-parse-bound-ignored": (
        "/tokenize and /detokenize bodies scanned under the 96 MiB default, not the plan's parse bound",
        [("router/api.c", "    prism_oai_parse_opts_t o = {.max_parse_bytes = r->max_parse_bytes};",
          "    prism_oai_parse_opts_t o = {.max_parse_bytes = 0 * r->max_parse_bytes};")],
        IT + "test_limits.py test_router_within_its_budget_under_a_burst", ["router"]),
    "tokenize-drops-image": (
        "/tokenize renders OpenAI image parts as they come (the template drops the placeholder)",
        [("router/api.c", "        json_array_foreach(msgs, i, m) router_prompt_template_message(m);",
          "        (void)i; (void)m;")],
        IT + "test_llama4.py test_template_and_tokenizer_through_router", ["router"]),
    "grammar-shared-skip-passes": (
        "the grammar tests on the shared tokenizers pass when the tokenizers are absent",
        [("tests/unit/grammar/gram_test_util.h", "    return missing ? 77 :", "    return missing ? 0 :")],
        "PRISM_SHARED_DIR=/nonexistent $BUILD/tests/unit/grammar/test_grammar_json --shared; test $? -eq 77",
        ["test_grammar_json"]),
    "api-spec-skip-passes": (
        "test_api's checks against the OpenAI spec pass when the spec is absent",
        [("tests/integration/test_api.py",
          "        raise Skip(\"the OpenAI spec is not at %s (PRISM_OPENAPI_DIR), or PyYAML is missing\" % SPEC_DIR)",
          "        return")],
        "PRISM_OPENAPI_DIR=/nonexistent " + IT + "test_api.py test_shapes_against_the_spec; test $? -eq 77", []),
    "prefix-key-without-image": (
        "the prefix cache's block keys leave the image out (placeholder tokens alone name its KV)",
        [("common/kv/prefix.c", "            XXH3_128bits_update(&st, rec, sizeof rec);", "            (void)rec;")],
        IT + "test_e2e.py test_prefix_cache_never_aliases", ["prefill_worker", "router"]),   # the router computes the keys too
    "prefix-image-rows-from-zero": (
        "a prompt that reads part of an image from the prefix cache lays that image's rows from its first",
        [("prefill_worker/main.c", "            x->next_row[i] += r->tokens[t] == p->cfg.image_token_index;", "            (void)t;")],
        IT + "test_llama4.py test_prefix_cache_same_logprobs", ["prefill_worker"]),
    "router-held-tokens-fixed-bound": (
        "the router holds at most 256 decode messages for a first token that trails them (a long answer fails)",
        [("router/requests.c",
          "    if (q->held_tokens + (int64_t)n_ids > may || q->n_held >= may + ROUTER_MAX_HELD_TOKENS) {",
          "    if (q->n_held >= ROUTER_MAX_HELD_TOKENS) {")],
        IT + "test_liveness.py", ["router"]),
    "router-drops-late-encode-done": (
        "the router drops the timings of an EncodeDone that comes after its request ended (a short answer)",
        [("router/requests.c",
          "    for (int i = 0; i < q->prompt.n_images; i++) router_sched_encode_let_go(q, i);",
          "    for (int i = 0; i < q->prompt.n_images; i++) router_sched_encode_done(q, i);")],
        IT + "test_encoder.py test_encoder_timed_when_its_answer_comes_after_the_request", ["router"]),
    "router-times-early-encode-done": (
        "the router times every EncodeDone of an id that is no request (an early job's too: its image twice)",
        [("router/requests.c",
          "    if (!q) return router_early_encode_done(r, from, rid, rid_hi, d);  /* an early job, or a request that ended */",
          "    if (!q) { encode_observe(r, from, d); return router_early_encode_done(r, from, rid, rid_hi, d); }")],
        IT + "test_encoder.py test_early_encoded_image_timed_once", ["router"]),
    "router-late-encode-done-twice": (
        "the router times a late EncodeDone each time it comes (a duplicate, or another encoder's)",
        [("router/workers.c", "        e->rid = 0;   /* once */", "        (void)0;")],
        "ctest --test-dir $BUILD -R '^test_router_pick$' --output-on-failure", ["test_router_pick"]),
    "prefix-route-ignores-index": (
        "the router's prefill pick ignores what each prefill's prefix cache holds (load alone)",
        [("router/workers.c", "        int hit = prefix_hit(w, want);", "        int hit = 0;")],
        IT + "test_e2e.py test_prefix_routing_and_encoder_skip", ["router"]),
    "prefill-own-prefix-keys": (
        "the prefill keeps its blocks under keys of its own secret, not the router's (no index ever matches)",
        [("prefill_worker/main.c", "    if (r->n_keys) {   /* on_prefill checked the count */", "    if (0) {")],
        IT + "test_e2e.py test_prefix_routing_and_encoder_skip", ["prefill_worker"]),
    "skip-without-coverage": (
        "a prefill runs a prompt whose skipped image its cache no longer covers (no embeddings behind it)",
        [("prefill_worker/main.c",
          "        if (r->img_cached[i] && r->span_off[i] + r->span_len[i] > (uint32_t)cached) return false;",
          "        (void)cached;")],
        IT + "test_e2e.py test_prefix_routing_and_encoder_skip", ["prefill_worker"]),
    "prefix-miss-not-resent": (
        "the router fails a request its prefill refused for a lost prefix instead of sending it again encoded",
        [("router/requests.c", "    if (q->stage != STAGE_SENT || q->place.no_skip || r->queue_len == r->reqs_cap) return false;",
          "    return false;")],
        IT + "test_e2e.py test_prefix_routing_and_encoder_skip", ["router"]),
    "decode-recomputes-n2-choice": (
        "a choice of an n > 1 request taken for recompute when the pool runs out (its router cannot restart one choice)",
        [("decode_worker/main.c", "    return prism_seq_n(&s->seq) == 1;", "    return true;")],
        IT + "test_limits.py test_decode_preempts_by_recompute_or_swap_and_priority_overtakes", ["decode_worker"]),
    "decode-choices-share-unrefcounted": (
        "the choices of n > 1 share the prompt's blocks without holding them (the first to end frees them)",
        [("decode_worker/main.c", "            rc = prism_kv_blocks_share(&d->blocks, s->blocks, shared);",
          "            rc = PRISM_OK;")],
        IT + "test_limits.py test_decode_preempts_by_recompute_or_swap_and_priority_overtakes", ["decode_worker"]),
    "kv-release-ignores-holders": (
        "a shared KV block is freed at its first release, whoever else holds it",
        [("common/kv/kv.c", "        if (--b->holders[ids[i]]) continue;", "        if (--b->holders[ids[i]] && 0) continue;")],
        "ctest --test-dir $BUILD -R '^test_kv_swap$' --output-on-failure", ["test_kv_swap"]),
    "bf16dp-drops-k-tail": (
        "the AVX-512 BF16 matmul drops the last K % 32 products (issue 33)",
        [("common/backend/cpu/cpu_kern_avx512bf16.c", "    if (k < K) {\n        __mmask32 m",
          "    if (0 && k < K) {\n        __mmask32 m")],
        "ctest --test-dir $BUILD -R '^(test_backend_cpu|test_model_golden)$' --output-on-failure",
        ["test_backend_cpu", "test_model_golden"]),
    "bf16p-pairs-swapped": (
        "the packed bf16 weights swap the two k of each interleaved pair (issue 33)",
        [("common/backend/cpu/cpu_kern_scalar.c", "d[((size_t)j * C + c) * 2 + e] = c < cols",
          "d[((size_t)j * C + c) * 2 + (1 - e)] = c < cols")],
        "ctest --test-dir $BUILD -R '^(test_backend_cpu|test_model_golden)$' --output-on-failure",
        ["test_backend_cpu", "test_model_golden"]),
    "bf16p-tail-unmasked": (
        "the packed bf16 matmul stores all 16 columns of a partial last panel (past N)",
        [("common/backend/cpu/cpu_kern_avx512bf16.c",
          "const __mmask16 lastm = N % PRISM_CPU_BF16P_COLS ? LANES(N % PRISM_CPU_BF16P_COLS) : (__mmask16)0xffff;",
          "const __mmask16 lastm = (__mmask16)0xffff;")],
        "ctest --test-dir $BUILD -R '^test_backend_cpu$' --output-on-failure", ["test_backend_cpu"]),
    "f32p-pairs-swapped": (
        "the fp32 kernel on packed bf16 weights widens the two k of each pair the wrong way round",
        [("common/backend/cpu/cpu_kern_avx512.c",
          "            __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));\n"
          "            __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));",
          "            __m512 wo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));\n"
          "            __m512 we = _mm512_castsi512_ps(_mm512_and_si512(v, hi));")],
        "ctest --test-dir $BUILD -R '^(test_backend_cpu|test_model_golden)$' --output-on-failure",
        ["test_backend_cpu", "test_model_golden"]),
    "f32p-odd-k-dropped": (
        "the fp32 kernel on packed bf16 weights drops the last k of an odd K",
        [("common/backend/cpu/cpu_kern_avx512.c", "    if (K & 1)   /* the last k alone",
          "    if (0 && (K & 1))   /* the last k alone")],
        "ctest --test-dir $BUILD -R '^test_backend_cpu$' --output-on-failure", ["test_backend_cpu"]),
    "bf16p-tp-pack-whole-k": (
        "a tensor-parallel rank packs its o_proj column slice as if it held every column",
        [("common/model/llm.c", "(rc = prism_wload_pack_matmul(w, ly->wo, H, nq_l)))",
          "(rc = prism_wload_pack_matmul(w, ly->wo, H, nq)))")],
        "ctest --test-dir $BUILD -R '^test_model_tp$' --output-on-failure", ["test_model_tp"]),
    "bf16-compute-ignored": (
        "--compute-dtype bf16 accepted but the matmuls keep fp32 arithmetic (x not rounded)",
        [("common/backend/cpu/cpu_backend.c", "mm_mode_t mode = !bf16 ? MM_F32 : !c->bf16dp ? MM_BF16W",
          "mm_mode_t mode = !bf16 ? MM_F32 : 1 ? MM_BF16W")],
        "ctest --test-dir $BUILD -R '^test_backend_cpu$' --output-on-failure", ["test_backend_cpu"]),
    "bf16-emulation-unrounded": (
        "the emulation of --compute-dtype bf16 (a CPU without AVX-512 BF16) leaves x unrounded",
        [("common/backend/cpu/cpu_backend.c",
          "                t->k->round_bf16(xr + (size_t)r * t->K, x + (size_t)(r0 + r) * t->ldx, (size_t)t->K);",
          "                memcpy(xr + (size_t)r * t->K, x + (size_t)(r0 + r) * t->ldx, (size_t)t->K * 4);")],
        "ctest --test-dir $BUILD -R '^test_backend_cpu$' --output-on-failure", ["test_backend_cpu"]),
    "qkrows-drops-key-tail": (
        "the vector qk_rows (decode attention scores) leaves the last key of an n % 4 tail unscored",
        [("common/backend/cpu/cpu_kern_simd.h", "        for (; j < n; j++) qkr_tail((mr), s + j,",
          "        for (; j + 1 < n; j++) qkr_tail((mr), s + j,")],
        "ctest --test-dir $BUILD -R '^test_backend_cpu$' --output-on-failure", ["test_backend_cpu"]),
    "launch-drops-compute-dtype": (
        "deploy/launch.sh takes --compute-dtype but does not pass it to the workers",
        [("deploy/launch.sh", ' --compute-dtype "$compute_dtype"', "")],
        IT + "test_supervisor.py test_launch_gives_the_routers_the_api_key_in_a_file", ["encoder_worker"]),
    "compute-dtype-contradiction-accepted": (
        "a worker takes --compute-dtype bf16 beside an explicit --weight-dtype f32",
        [("common/worker/start.c", '    if (!strcmp(o->compute_dtype, "bf16") && !strcmp(o->weight_dtype, "f32")) {',
          "    if (0) {")],
        IT + "test_supervisor.py test_launch_gives_the_routers_the_api_key_in_a_file",
        ["encoder_worker", "prefill_worker", "decode_worker"]),
    "weight-auto-keeps-f32": (
        "--weight-dtype auto widens a checkpoint whose matrices are all bf16 to fp32 on the CPU",
        [("common/worker/start.c", "    bool bf16 = prism_st_matrix_dtype(st, &dt) == PRISM_OK && dt == PRISM_ST_BF16;",
          "    bool bf16 = prism_st_matrix_dtype(st, &dt) == PRISM_OK && 0;")],
        "FIDELITY_CASES=text_hello,text_unicode " + IT + "test_fidelity.py", ["encoder_worker", "prefill_worker", "decode_worker"]),
    "matrix-dtype-ignores-mix": (
        "a checkpoint whose matrices mix dtypes answers the last one's (auto would round the others to bf16)",
        [("common/model/safetensors.c", "        if (any && t->dtype != *out) return PRISM_EINVAL;", "")],
        "ctest --test-dir $BUILD -R '^test_safetensors$' --output-on-failure", ["test_safetensors"]),
    "nginx-keepalive-outlives-router": (
        "nginx keeps idle connections to the routers as long as a router does (60 s): a router may close "
        "one under a request nginx writes (502)",
        [("deploy/nginx/prism.conf", "    keepalive_timeout 50s;\n}", "    keepalive_timeout 60s;\n}")],
        IT + "test_loadbalancer.py nginx test_example_config_is_what_runs", []),
    "haproxy-keepalive-outlives-router": (
        "HAProxy keeps a client's idle connection, and the router connection it holds, as long as a router "
        "does (60 s): a router may close one under a request HAProxy writes",
        [("deploy/haproxy/prism.cfg", "    timeout http-keep-alive 50s\n", "    timeout http-keep-alive 60s\n")],
        IT + "test_loadbalancer.py haproxy test_example_config_is_what_runs", []),
    "haproxy-pools-idle-router-connections": (
        "HAProxy pools idle router connections between clients (http-reuse safe, its default): one stays "
        "until a purge gets to it, with no bound under the router's idle timeout",
        [("deploy/haproxy/prism.cfg", "    http-reuse never\n", "")],
        IT + "test_loadbalancer.py haproxy test_example_config_is_what_runs", []),
    # KV on the wire in bf16 (issue 33, --kv-transfer-dtype)
    "kv-wire-dtype-unchecked": (
        "the decode worker takes a Kv first piece of any wire_dtype (an unknown one read as f32)",
        [("decode_worker/main.c",
          "    bool wire_ok = kv && (kv->wire_dtype == PRISM__KV_DTYPE__KV_DTYPE_F32 || kv->wire_dtype == PRISM__KV_DTYPE__KV_DTYPE_BF16);",
          "    bool wire_ok = kv != NULL;")],
        IT + "test_security.py test_decode_checks_kv_wire_dtype", ["decode_worker"]),
    "kv-widen-half": (
        "a bf16 piece widened by its wire length (half its values): the rest of the import is stale",
        [("decode_worker/main.c",
          "        prism_kv_wire_widen(bytes, piece_bytes(d, x->nb, first, n) / sizeof(float), d->wide);",
          "        prism_kv_wire_widen(bytes, prism_kv_wire_bytes(x->wire, piece_bytes(d, x->nb, first, n)) / sizeof(float), "
          "d->wide);")],
        IT + "test_kv_route.py test_kv_transfer_in_bf16", ["decode_worker"]),
    "kv-piece-f32-length": (
        "a later piece of a bf16 transfer checked against its f32 length",
        [("decode_worker/main.c", "        len != prism_kv_wire_bytes(x->wire, piece_bytes(d, x->nb, first, n))) {",
          "        len != piece_bytes(d, x->nb, first, n)) {")],
        IT + "test_kv_route.py test_kv_transfer_in_bf16", ["decode_worker"]),
    "kv-piece-f32-blocks": (
        "a bf16 first piece held to an f32 piece's block count (bf16 pieces hold twice the blocks)",
        [("decode_worker/main.c", "        n < 1 || n > total || n > d->piece_blocks[w] ||",
          "        n < 1 || n > total || n > d->piece_blocks[PRISM_KV_WIRE_F32] ||")],
        IT + "test_kv_route.py test_kv_transfer_in_bf16", ["decode_worker"]),
    "prefill-bf16-f32-header": (
        "the prefill sends bf16 frames under a header giving the fp32 block size",
        [("prefill_worker/main.c", "    p->kv_hdr.block_bytes = prism_kv_wire_bytes(p->wire, fbb);",
          "    p->kv_hdr.block_bytes = fbb;")],
        IT + "test_kv_route.py test_kv_transfer_in_bf16", ["prefill_worker"]),
    "migration-unnarrowed": (
        "a decode worker migrating in bf16 sends the first half of its fp32 export (not narrowed)",
        [("decode_worker/main.c",
          "        if (d->wire == PRISM_KV_WIRE_BF16) prism_kv_wire_narrow(d->mig_piece, piece_bytes(d, nb, k, n) / sizeof(float));\n",
          "")],
        IT + "test_limits.py test_migration_in_bf16", ["decode_worker"]),
    "prefill-group-unnarrowed": (
        "a prefill group's leader sends the KV it gathered unnarrowed under a bf16 header",
        [("prefill_worker/main.c", "    if (erc == PRISM_OK && p->wire == PRISM_KV_WIRE_BF16) {",
          "    if (erc == PRISM_OK && p->wire == PRISM_KV_WIRE_BF16 && p->tp.size <= 1) {")],
        IT + "test_tp.py test_bf16_transfer_between_groups", ["prefill_worker"]),
    "prefill-narrows-full-part-only": (
        "the prefill narrows the full layers' part of a transfer and leaves the chunked layers' part fp32",
        [("prefill_worker/main.c", "        prism_kv_wire_narrow(p->kv_out, p->kv_len / sizeof(float));",
          "        prism_kv_wire_narrow(p->kv_out, (size_t)nb * fbb / sizeof(float));")],
        IT + "test_llama4.py test_bf16_transfer_with_chunked_layers", ["prefill_worker"]),
    "kv-wire-auto-ignores-compute": (
        "--kv-transfer-dtype auto stays f32 under --compute-dtype bf16",
        [("common/kv/kv.c",
          '*out = compute_dtype && !strcmp(compute_dtype, "bf16") ? PRISM_KV_WIRE_BF16 : PRISM_KV_WIRE_F32;',
          "*out = PRISM_KV_WIRE_F32;")],
        IT + "test_supervisor.py test_launch_gives_the_routers_the_api_key_in_a_file",
        ["prefill_worker", "decode_worker"]),
    "kv-narrow-truncates": (
        "fp32 -> bf16 on the wire truncates instead of rounding to nearest even",
        [("common/kv/kv.c", "        uint16_t h = prism_f32_to_bf16(f);",
          "        uint32_t u_;\n        memcpy(&u_, &f, 4);\n        uint16_t h = (uint16_t)(u_ >> 16);")],
        "ctest --test-dir $BUILD -R '^test_core$' --output-on-failure", ["test_core"]),
}


def sh(cmd, cwd, env=None, log=None, timeout=None):
    with open(log, "ab") if log else open(os.devnull, "wb") as out:
        return subprocess.run(cmd, shell=True, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode


def prepare(work, log):
    """A scratch worktree of HEAD (made once, then reset to HEAD) and its configured build."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    src, build = os.path.join(work, "src"), os.path.join(work, "build")
    if not os.path.isdir(os.path.join(src, ".git")) and not os.path.isfile(os.path.join(src, ".git")):
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
        subprocess.run(["git", "worktree", "add", "--detach", src, head], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["git", "checkout", "--detach", "-f", head], cwd=src, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    subprocess.run(["git", "reset", "--hard", "-q"], cwd=src, check=True)
    # the models and the shared folder sit beside the checkout (tests read ../shared)
    if not os.path.exists(os.path.join(work, "shared")) and os.path.isdir(os.path.join(ROOT, "..", "shared")):
        os.symlink(os.path.abspath(os.path.join(ROOT, "..", "shared")), os.path.join(work, "shared"))
    if not os.path.isfile(os.path.join(build, "CMakeCache.txt")):
        rc = sh("cmake -S %s -B %s -DCMAKE_BUILD_TYPE=Release -DPRISM_CUDA=OFF -DCMAKE_C_COMPILER_LAUNCHER=ccache "
                "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache" % (src, build), src, log=log)
        if rc:
            sys.exit("cmake failed (see %s)" % log)
    return src, build


def build_all(src, build, log, jobs):
    return sh("cmake --build %s -j%d" % (build, jobs), src, log=log)


def run_test(cmd, src, build, log, timeout):
    env = dict(os.environ, PRISM_BINARY_DIR=build, PRISM_SOURCE_DIR=src, BUILD=build)
    try:
        return sh(cmd.replace("$BUILD", build), src, env=env, log=log, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"


def apply(src, edits):
    for rel, old, new in edits:
        p = os.path.join(src, rel)
        with open(p) as f:
            text = f.read()
        n = text.count(old)
        if n != 1:
            raise RuntimeError("%s: the text to mutate occurs %d times (the source moved: update the mutant)" % (rel, n))
        with open(p, "w") as f:
            f.write(text.replace(old, new))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "mutants"))
    ap.add_argument("--baseline", action="store_true", help="first run each named test unmutated (it must pass)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--clean", action="store_true", help="remove the scratch worktree and its build, then exit")
    args = ap.parse_args()
    if args.clean:
        src = os.path.join(args.work, "src")
        if os.path.exists(src):
            subprocess.run(["git", "worktree", "remove", "--force", src], cwd=ROOT)
        shutil.rmtree(args.work, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT)
        return 0
    if args.list:
        for n, (what, _, test, _) in MUTANTS.items():
            print("%-28s %s\n%-28s   test: %s" % (n, what, "", test))
        return 0
    names = args.names or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        sys.exit("unknown mutants: %s (--list)" % unknown)
    os.makedirs(args.work, exist_ok=True)
    log = os.path.join(args.work, "run.log")
    open(log, "w").close()
    src, build = prepare(args.work, log)
    print("scratch tree %s, build %s, log %s" % (src, build, log), flush=True)
    if build_all(src, build, log, args.jobs):
        sys.exit("the unmutated tree does not build (see %s)" % log)
    if args.baseline:
        for test in sorted({MUTANTS[n][2] for n in names}):
            t0 = time.time()
            rc = run_test(test, src, build, log, args.timeout)
            print("baseline %-6s %5.0fs  %s" % ("ok" if rc == 0 else "FAILS(%s)" % rc, time.time() - t0, test), flush=True)
            if rc != 0:
                sys.exit("a named test fails unmutated: it cannot tell a mutant (see %s)" % log)
    missed = []
    for n in names:
        what, edits, test, _targets = MUTANTS[n]
        t0 = time.time()
        subprocess.run(["git", "checkout", "-f", "-q", "--", "."], cwd=src, check=True)
        with open(log, "a") as f:
            f.write("\n===== mutant %s: %s\n" % (n, what))
        apply(src, edits)
        if build_all(src, build, log, args.jobs):
            verdict = "BROKEN (does not build)"   # a mutant must build, or it shows nothing
            missed.append(n)
        else:
            rc = run_test(test, src, build, log, args.timeout)
            verdict = "caught" if rc != 0 else "MISSED"
            if verdict == "MISSED":
                missed.append(n)
        print("%-28s %-24s %5.0fs  %s" % (n, verdict, time.time() - t0, test), flush=True)
    subprocess.run(["git", "checkout", "-f", "-q", "--", "."], cwd=src, check=True)
    build_all(src, build, log, args.jobs)   # leave the scratch build unmutated
    print("%d mutants, %d caught, %d missed%s" % (len(names), len(names) - len(missed), len(missed),
                                                 (": " + ", ".join(missed)) if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
