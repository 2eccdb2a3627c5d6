/* Text RoPE inverse frequencies as transformers computes them (llama3 scaling when configured).
 * Apart from config.c so that the model library needs no JSON parser. */
#include "model/model.h"

#include <math.h>

void prism_model_rope_inv_freq(const prism_model_config_t *c, float *inv)
{
    int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        /* HF computes base ** (arange(0, dim, 2) / dim) in fp32 */
        float expo = (float)(2 * i) / (float)c->head_dim;
        float f = 1.0f / powf(c->rope_theta, expo);
        if (c->rope_scaling_type == 1) {
            float old = (float)c->rope_orig_max_pos;
            float lw = old / c->rope_low_freq_factor, hw = old / c->rope_high_freq_factor;
            float wl = 2.0f * (float)M_PI / f;
            float scaled = wl > lw ? f / c->rope_factor : f;
            if (!(wl < hw) && !(wl > lw)) {
                float s = (old / wl - c->rope_low_freq_factor) / (c->rope_high_freq_factor - c->rope_low_freq_factor);
                scaled = (1 - s) * scaled / c->rope_factor + s * scaled;
            }
            f = scaled;
        }
        inv[i] = f;
    }
}
