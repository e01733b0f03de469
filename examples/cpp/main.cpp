// rope_ext from C++: Llama-3.1-style frequencies, cos/sin tables, and q/k rotated with
// rotary_qk (grouped-query attention: 8 query heads, 2 key/value heads). Then it checks the
// property RoPE exists for: the score q_i . k_j depends on j - i only.
// Exit status 0 when every check passes, 1 otherwise.
#include <ATen/ATen.h>
#include <rope_ext/rope.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

int main() {
  constexpr int64_t B = 2, H = 8, H_KV = 2, S = 16, D = 128;
  at::manual_seed(0);

  rope_ext::RopeScaling scaling;
  scaling.rope_type = "llama3";
  scaling.factor = 8.0;
  scaling.low_freq_factor = 1.0;
  scaling.high_freq_factor = 4.0;
  scaling.original_max_position_embeddings = 8192;
  const rope_ext::RopeFrequencies freqs =
      rope_ext::rope_frequencies(scaling, /*base=*/500000.0, /*rotary_dim=*/D, /*max_position_embeddings=*/131072);
  std::printf("llama3 inv_freq: %lld values, from %.6g down to %.6g\n",
              static_cast<long long>(freqs.inv_freq.numel()), freqs.inv_freq[0].item<double>(),
              freqs.inv_freq[-1].item<double>());

  // Tables for positions 0..S-1 of every sequence: (B, S, D), plus a heads dim: (B, 1, S, D).
  const at::Tensor positions = at::arange(S, at::kLong).expand({B, S});
  auto [cos, sin] = rope_ext::cos_sin_tables(positions, rope_ext::inv_freq_for(freqs, S - 1),
                                             /*interleaved=*/false, freqs.attention_factor);
  cos = cos.unsqueeze(1), sin = sin.unsqueeze(1);

  const at::Tensor q = at::randn({B, H, S, D}), k = at::randn({B, H_KV, S, D});
  const auto [q_rot, k_rot] = rope_ext::rotary_qk(q, k, cos, sin);
  std::printf("q %s -> %s, k %s -> %s, tables %s\n", c10::str(q.sizes()).c_str(), c10::str(q_rot.sizes()).c_str(),
              c10::str(k.sizes()).c_str(), c10::str(k_rot.sizes()).c_str(), c10::str(cos.sizes()).c_str());
  bool ok = q_rot.sizes() == q.sizes() && k_rot.sizes() == k.sizes();

  // Every query position holds the same unit vector u, every key position the same w. After
  // rotation the scores q_i . k_j must be constant along each diagonal j - i = const.
  const at::Tensor u = at::randn({D}), w = at::randn({D});
  const at::Tensor uq = (u / u.norm()).expand({B, H, S, D}), wk = (w / w.norm()).expand({B, H_KV, S, D});
  const auto [uq_rot, wk_rot] = rope_ext::rotary_qk(uq, wk, cos, sin);
  // Query head h reads key/value head h / (H / H_KV).
  const at::Tensor k_heads = wk_rot.repeat_interleave(H / H_KV, /*dim=*/1);
  const at::Tensor scores = at::matmul(uq_rot, k_heads.transpose(-1, -2));  // (B, H, S, S)
  double toeplitz_dev = 0;
  for (int64_t offset = -(S - 1); offset < S; ++offset) {
    const at::Tensor diag = scores.diagonal(offset, -2, -1);  // (B, H, S - |offset|)
    toeplitz_dev = std::max(toeplitz_dev, (diag.max() - diag.min()).item<double>());
  }
  std::printf("scores q_i . k_j over %lld x %lld positions: max spread along a diagonal = %.3g\n",
              static_cast<long long>(S), static_cast<long long>(S), toeplitz_dev);
  ok = ok && toeplitz_dev < 1e-4;

  // The same far out, past the original 8192-token context: (p, p + 3) against (p + 5, p + 8).
  constexpr int64_t p = 100000;
  const at::Tensor far = at::tensor({p, p + 3, p + 5, p + 8}, at::kLong);
  const auto [cos_far, sin_far] = rope_ext::cos_sin_tables(far, freqs.inv_freq);
  const at::Tensor pairs = rope_ext::rotary(at::stack({u, w, u, w}), cos_far, sin_far);  // (4, D)
  const double dot_a = pairs[0].dot(pairs[1]).item<double>(), dot_b = pairs[2].dot(pairs[3]).item<double>();
  const double far_dev = std::abs(dot_a - dot_b) / (u.norm() * w.norm()).item<double>();
  std::printf("positions (%lld, %lld): %.6f, (%lld, %lld): %.6f, relative deviation %.3g\n",
              static_cast<long long>(p), static_cast<long long>(p + 3), dot_a, static_cast<long long>(p + 5),
              static_cast<long long>(p + 8), dot_b, far_dev);
  ok = ok && far_dev < 1e-4;

  std::printf("%s\n", ok ? "OK: scores depend only on relative position" : "FAILED");
  return ok ? 0 : 1;
}
