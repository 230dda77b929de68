// The sampling penalties and the logit bias (lumo.engine.sampling.adjust), shared by the sampler
// (sampling.cu) and the drafter's candidate selection (tree_ops.cu topk_partial).
#pragma once

#define PATH_MAX 64  // path tokens a row's penalties may add to the history (a tree's depth)

struct Penalty {
  bool on;    // the penalties: repetition != 1, frequency != 0 or presence != 0
  bool bias;  // x + bias[id] first
  bool ban;   // before that, x = -inf for the stop tokens (min_tokens)
  float rep, freq, pres;  // repetition, frequency, presence
};

// Row t's settings from penalty [T, 4] (null: none): repetition, frequency, presence, and 1 where the row
// adds the logit bias [V] (null: no bias anywhere). The stop-token ban (row_bans) is the sampler's alone.
__device__ __forceinline__ Penalty row_penalty(const float* penalty, const float* bias, int t) {
  Penalty p;
  p.rep = penalty == nullptr ? 1.0f : penalty[4 * t];
  p.freq = penalty == nullptr ? 0.0f : penalty[4 * t + 1];
  p.pres = penalty == nullptr ? 0.0f : penalty[4 * t + 2];
  p.on = p.rep != 1.0f || p.freq != 0.0f || p.pres != 0.0f;
  p.bias = penalty != nullptr && bias != nullptr && penalty[4 * t + 3] != 0.0f;
  p.ban = false;
  return p;
}

// min_tokens: row t, sampling absolute position `position`, bans the stop tokens (stop_mask [V] != 0)
// while position < ban_until[t] (null: never).
__device__ __forceinline__ bool row_bans(const unsigned char* stop_mask, const long long* ban_until, int t,
                                         long long position) {
  return stop_mask != nullptr && ban_until != nullptr && position < ban_until[t];
}

// torch's operations in lumo.engine.sampling.penalize, each rounded once (no contraction into an FMA):
// c = how often the token was generated, in_prompt = it is in the prompt.
__device__ __forceinline__ float penalized(float x, int c, bool in_prompt, const Penalty& p) {
  if (in_prompt || c > 0) x = x > 0.0f ? __fdiv_rn(x, p.rep) : __fmul_rn(x, p.rep);
  x = __fsub_rn(x, __fmul_rn(p.freq, (float)c));
  return __fsub_rn(x, __fmul_rn(p.pres, c > 0 ? 1.0f : 0.0f));
}
