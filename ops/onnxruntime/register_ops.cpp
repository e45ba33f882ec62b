// ONNX Runtime custom-operator library of lapformer_mm, domain lapformer_mm, fp32 (docs/deploy.md):
//
//   PairwiseKernel(X (..., N, d), Y (..., M, d)) -> K (..., N, M) = exp(-dist(x_i, y_j) / lam)
//   AttentionRows(X (B, N, H, d), L (B, H, m, d), V (B, N, H, dv))
//       -> rhs (B, H, m + 1, dv), stats (B, H, 2 | 0 (+ 1 if dv), m), rows (B, H, N | 0, m)
//   AttentionApply(rows (B, H, N, m), A (B, H, m, dv), bias (B, H, 1, dv)) -> out (B, N, H, dv)
//
// lam (float) and kind ('laplacian': l1 distance, 'gaussian': squared l2 distance) on the
// first two; AttentionRows' want_stats / want_rows (int) and AttentionApply's centre (int)
// are ops/cpu's attention_rows_forward / attention_rows_apply flags, the two
// passes of the eager CPU backend (lapformer_mm/ops/backends/cpu.py composes them; so does
// the exported graph): with C = K(X, L), rhs = [C^T (v - v̄) / N; v̄] (one pass, the
// centring applied to its sums after it), stats the column mean and variance over rows of the
// row-centred C, then (dv > 0) c̄ = colmean(C), rows C itself; out = C_i A + bias, C_i
// row-centred with centre. X and V come in the token layout the projections write, and out
// goes out in it: no transposes around the nodes. dv may be 0 (no rhs, no c̄).
//
// Built against ONNX Runtime's C API headers only: the library links nothing of ONNX
// Runtime, which hands it the API table in RegisterCustomOps, the one exported symbol. It
// asks GetApi for kApiVersion and calls nothing newer, and declares its OrtCustomOp at that
// version, so ONNX Runtime reads no field added later; one binary serves every release
// from 1.17 on.
//
// The instruction set is chosen when a session registers the library, and kept by that
// session's ops: AVX-512F, else AVX2 + FMA, else the generic build;
// LAPFORMER_ORT_ISA=default|avx2|avx512 forces one (the tests run each), and an unsupported
// request fails the registration with a message.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "onnxruntime_c_api.h"
#include "ops.h"

namespace lapf_ort {
namespace {

// 1.17: KernelContext_ParallelFor (15), CreateKernelV2/KernelComputeV2 (16) and the
// custom op's start/end versions (17).
constexpr uint32_t kApiVersion = 17;

const OrtApi* g_api = nullptr;
// One build's kernels. Each session's ops carry the build chosen when it registered the
// library (OpDef, then Kernel): nothing global changes at a later registration.
struct Isa {
  void (*kernel_rows)(const Problem&, int64_t, int64_t, int64_t);
  void (*rows_chunk)(const RowsPass&, int64_t, int64_t, float*);
  void (*apply_chunk)(const ApplyPass&, int64_t, int64_t, float*);
};

OrtStatus* error(const char* op, const std::string& message) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string("lapformer_mm::") + op + ": " + message).c_str());
}

#define LAPF_TRY(expr)              \
  do {                              \
    OrtStatus* status_ = (expr);    \
    if (status_) return status_;    \
  } while (0)

// A kernel's build and attributes; each op reads the attributes it has.
struct Kernel {
  Isa isa{};
  float lam = 0.0f;
  bool l1 = true;
  bool want_stats = false, want_rows = false, centre = false;
};

// An OrtCustomOp with what its callbacks need to tell the ops apart, and the build its
// kernels run (it is the first member: ONNX Runtime hands the callbacks its address).
struct OpDef {
  OrtCustomOp op;
  const char* name;
  size_t inputs, outputs;
  Isa isa;
};

const OpDef& def(const OrtCustomOp* op) { return *reinterpret_cast<const OpDef*>(op); }

struct Shape {
  std::vector<int64_t> dims;
  ONNXTensorElementDataType type;
};

OrtStatus* shape_of(const OrtValue* value, Shape* shape) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  LAPF_TRY(g_api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* status = g_api->GetDimensionsCount(info, &rank);
  if (!status) {
    shape->dims.resize(rank);
    status = g_api->GetDimensions(info, shape->dims.data(), rank);
  }
  if (!status) status = g_api->GetTensorElementType(info, &shape->type);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return status;
}

// Input i: its shape and data (GetTensorMutableData: GetTensorData is newer than the API
// version asked for).
OrtStatus* input(OrtKernelContext* context, size_t i, Shape* shape, const float** data) {
  const OrtValue* value = nullptr;
  LAPF_TRY(g_api->KernelContext_GetInput(context, i, &value));
  LAPF_TRY(shape_of(value, shape));
  void* raw = nullptr;
  LAPF_TRY(g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &raw));
  *data = static_cast<const float*>(raw);
  return nullptr;
}

OrtStatus* output(OrtKernelContext* context, size_t i, const std::vector<int64_t>& dims, float** data) {
  OrtValue* value = nullptr;
  LAPF_TRY(g_api->KernelContext_GetOutput(context, i, dims.data(), dims.size(), &value));
  void* raw = nullptr;
  LAPF_TRY(g_api->GetTensorMutableData(value, &raw));
  *data = static_cast<float*>(raw);
  return nullptr;
}

OrtStatus* read_kernel(const char* op, const OrtKernelInfo* info, Kernel* kernel) {
  LAPF_TRY(g_api->KernelInfoGetAttribute_float(info, "lam", &kernel->lam));
  // -1 / lam must be finite too: it scales every distance (0 * -inf would be NaN).
  if (!(kernel->lam > 0.0f) || !std::isfinite(-1.0f / kernel->lam)) {
    char value[32];
    std::snprintf(value, sizeof(value), "%g", static_cast<double>(kernel->lam));
    return error(op, std::string("attribute lam must be > 0 with a finite 1 / lam, got ") + value);
  }
  size_t size = 0;  // with the terminating null
  LAPF_TRY(g_api->KernelInfoGetAttribute_string(info, "kind", nullptr, &size));
  std::string name(size, '\0');
  LAPF_TRY(g_api->KernelInfoGetAttribute_string(info, "kind", &name[0], &size));
  name.resize(size ? size - 1 : 0);
  if (name != "laplacian" && name != "gaussian")
    return error(op, "attribute kind='" + name + "' is not supported; allowed: 'laplacian', 'gaussian'");
  kernel->l1 = name == "laplacian";
  return nullptr;
}

OrtStatus* read_flag(const char* op, const OrtKernelInfo* info, const char* name, bool* flag) {
  int64_t value = 0;
  LAPF_TRY(g_api->KernelInfoGetAttribute_int64(info, name, &value));
  if (value != 0 && value != 1)
    return error(op, std::string("attribute ") + name + " must be 0 or 1, got " + std::to_string(value));
  *flag = value == 1;
  return nullptr;
}

int64_t padded(int64_t n) { return (n + kPadLanes - 1) / kPadLanes * kPadLanes; }
int64_t chunks_of(int64_t n) { return (n + kChunkRows - 1) / kChunkRows; }

// y (batch, m, d) transposed into (batch, d, padded), zeros beyond m.
std::vector<float> transposed(const float* y, int64_t batch, int64_t m, int64_t d, int64_t mp) {
  std::vector<float> yt(static_cast<size_t>(batch * d * mp), 0.0f);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < m; ++j)
      for (int64_t k = 0; k < d; ++k) yt[(b * d + k) * mp + j] = y[(b * m + j) * d + k];
  return yt;
}

// No C++ exception may cross ONNX Runtime's C API (a task's would end the process in its
// thread pool): the computes and the tasks turn one into an error status. The messages are
// literals, which need no memory.
OrtStatus* exception_status(const char* what) {
  return g_api->CreateStatus(ORT_FAIL, what);
}

// Calls fn(index) for index in [0, count) on the session's threads.
template <typename Fn>
OrtStatus* parallel_for(OrtKernelContext* context, int64_t count, Fn& fn) {
  if (count == 0) return nullptr;
  struct Tasks {
    Fn* fn;
    std::atomic<bool> out_of_memory{false};
  } tasks{&fn};
  auto run = [](void* data, size_t index) {
    Tasks* t = static_cast<Tasks*>(data);
    try {
      (*t->fn)(static_cast<int64_t>(index));
    } catch (...) {
      t->out_of_memory = true;  // the tasks allocate, and throw nothing else
    }
  };
  LAPF_TRY(g_api->KernelContext_ParallelFor(context, run, static_cast<size_t>(count), 0, &tasks));
  return tasks.out_of_memory ? exception_status("lapformer_mm op library: out of memory in a task") : nullptr;
}

// The (b, h) of task `index` of a pass: the heads of one chunk of rows run one after
// another, so each reads the cache lines of x and v (B, N, H, d) that the one before
// brought in (and writes the lines of out the one before began).
int64_t head_major(int64_t index, int64_t heads, int64_t chunks) {
  return index / (heads * chunks) * heads + index % heads;
}

// One scratch buffer per thread, grown to the largest request.
float* thread_scratch(int64_t size) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(size)) buffer.resize(static_cast<size_t>(size));
  return buffer.data();
}

// PairwiseKernel ------------------------------------------------------------------------------

constexpr const char* kPairwise = "PairwiseKernel";

OrtStatus* create_pairwise(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** out) {
  Kernel kernel{def(op).isa};
  LAPF_TRY(read_kernel(kPairwise, info, &kernel));
  *out = new Kernel(kernel);
  return nullptr;
}

OrtStatus* compute_pairwise(void* op_kernel, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  Shape xs, ys;
  const float* x = nullptr;
  const float* y = nullptr;
  LAPF_TRY(input(context, 0, &xs, &x));
  LAPF_TRY(input(context, 1, &ys, &y));
  size_t rank = xs.dims.size();
  if (rank < 2 || ys.dims.size() != rank)
    return error(kPairwise, "X and Y must have the same rank >= 2 (..., N, d) and (..., M, d)");
  for (size_t i = 0; i + 2 < rank; ++i)
    if (xs.dims[i] != ys.dims[i]) return error(kPairwise, "X and Y must have the same leading dimensions");
  if (xs.dims[rank - 1] != ys.dims[rank - 1]) return error(kPairwise, "X and Y must have the same last dimension d");
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) batch *= xs.dims[i];
  int64_t n = xs.dims[rank - 2], m = ys.dims[rank - 2], d = xs.dims[rank - 1];
  std::vector<int64_t> out_dims(xs.dims.begin(), xs.dims.end() - 1);
  out_dims.back() = n;
  out_dims.push_back(m);
  float* out = nullptr;
  LAPF_TRY(output(context, 0, out_dims, &out));
  if (batch == 0 || n == 0 || m == 0) return nullptr;
  const int64_t mp = padded(m), chunks = chunks_of(n);
  std::vector<float> yt = transposed(y, batch, m, d, mp);
  Problem problem{x, yt.data(), out, n, m, d, mp, 1, n * d, 0, d, kernel.lam, kernel.l1};
  auto task = [&](int64_t index) {
    const int64_t b = index / chunks, begin = (index % chunks) * kChunkRows;
    kernel.isa.kernel_rows(problem, b, begin, begin + kChunkRows < n ? begin + kChunkRows : n);
  };
  return parallel_for(context, batch * chunks, task);
}

// AttentionRows -------------------------------------------------------------------------------

constexpr const char* kRows = "AttentionRows";

OrtStatus* create_rows(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** out) {
  Kernel kernel{def(op).isa};
  LAPF_TRY(read_kernel(kRows, info, &kernel));
  LAPF_TRY(read_flag(kRows, info, "want_stats", &kernel.want_stats));
  LAPF_TRY(read_flag(kRows, info, "want_rows", &kernel.want_rows));
  *out = new Kernel(kernel);
  return nullptr;
}

OrtStatus* compute_rows(void* op_kernel, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  Shape xs, ls, vs;
  const float* x = nullptr;
  const float* l = nullptr;
  const float* v = nullptr;
  LAPF_TRY(input(context, 0, &xs, &x));
  LAPF_TRY(input(context, 1, &ls, &l));
  LAPF_TRY(input(context, 2, &vs, &v));
  if (xs.dims.size() != 4 || ls.dims.size() != 4 || vs.dims.size() != 4)
    return error(kRows, "X (B, N, H, d), L (B, H, m, d) and V (B, N, H, dv) must be 4-D");
  const int64_t B = xs.dims[0], N = xs.dims[1], H = xs.dims[2], d = xs.dims[3], m = ls.dims[2];
  if (ls.dims[0] != B || ls.dims[1] != H || ls.dims[3] != d)
    return error(kRows, "L must be (B, H, m, d) with B, H and d of X (B, N, H, d)");
  if (vs.dims[0] != B || vs.dims[1] != N || vs.dims[2] != H)
    return error(kRows, "V must be (B, N, H, dv) with B, N and H of X (B, N, H, d)");
  const int64_t dv = vs.dims[3], BH = B * H;
  // The statistics' rows: the whitening's mean and variance when wanted, then c̄ with v.
  const int64_t stat_rows = (kernel.want_stats ? 2 : 0) + (dv ? 1 : 0);
  float* rhs = nullptr;
  float* stats = nullptr;
  float* rows = nullptr;
  LAPF_TRY(output(context, 0, {B, H, m + 1, dv}, &rhs));
  LAPF_TRY(output(context, 1, {B, H, stat_rows, m}, &stats));
  LAPF_TRY(output(context, 2, {B, H, kernel.want_rows ? N : 0, m}, &rows));
  if (BH == 0) return nullptr;
  if (N == 0 || m == 0) {
    std::fill(rhs, rhs + BH * (m + 1) * dv, 0.0f);
    std::fill(stats, stats + BH * stat_rows * m, 0.0f);
    return nullptr;
  }
  const int64_t mp = padded(m), dvp = padded(dv), chunks = chunks_of(N);
  std::vector<float> lt = transposed(l, BH, m, d, mp);
  Problem problem{x, lt.data(), nullptr, N, m, d, mp, H, N * H * d, d, H * d, kernel.lam, kernel.l1};
  // The statistics' shift per (b, h): the centred mean of kShiftRows evenly spaced rows,
  // close to every column's mean, so the one-pass sums around it do not cancel.
  std::vector<float> shift(kernel.want_stats ? static_cast<size_t>(BH * mp) : 0, 0.0f);
  if (kernel.want_stats) {
    const int64_t samples = std::min(N, kShiftRows);
    std::vector<float> row(static_cast<size_t>(BH * m));
    std::vector<double> sum(static_cast<size_t>(m));
    Problem one = problem;
    one.n = 1;
    one.out = row.data();
    for (int64_t bh = 0; bh < BH; ++bh) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t k = 0; k < samples; ++k) {
        one.x = x + (k * N / samples) * problem.sx_row;
        kernel.isa.kernel_rows(one, bh, 0, 1);
        const float* r = row.data() + bh * m;
        float total = 0.0f;
        for (int64_t j = 0; j < m; ++j) total += r[j];
        const float mean = total / static_cast<float>(m);
        for (int64_t j = 0; j < m; ++j) sum[j] += static_cast<double>(r[j] - mean);
      }
      for (int64_t j = 0; j < m; ++j) shift[bh * mp + j] = static_cast<float>(sum[j] / samples);
    }
  }
  const int64_t rhs_part = dv ? m * dvp + mp : 0, common_part = dv ? 2 * dv + 1 : 0;
  std::vector<float> rhs_parts(static_cast<size_t>(BH * chunks * rhs_part));
  std::vector<double> common_parts(static_cast<size_t>(BH * chunks * common_part));
  std::vector<float> stat_parts(static_cast<size_t>(kernel.want_stats ? BH * chunks * 2 * mp : 0));
  RowsPass pass{problem, v, dv, dvp, chunks, kernel.want_rows ? rows : nullptr,
                kernel.want_stats ? shift.data() : nullptr, rhs_parts.data(), common_parts.data(),
                stat_parts.data()};
  const int64_t scratch = rows_scratch(mp, dvp);
  auto task = [&](int64_t index) {
    const int64_t bh = head_major(index, H, chunks);
    kernel.isa.rows_chunk(pass, bh, (index / H) % chunks, thread_scratch(scratch));
  };
  LAPF_TRY(parallel_for(context, BH * chunks, task));
  // The partials in chunk order: float for the centred sums, double for the rest. Then, in
  // double, v̄ = Σv / N, R = [C̃^T v - (C̃^T 1) v̄^T] / N + 1 [r^T v - (Σr) v̄^T] / N and
  // c̄ = (C̃^T 1 + Σr) / N (C̃ = C - r 1^T).
  std::vector<float> sums(static_cast<size_t>(rhs_part));
  std::vector<double> common(static_cast<size_t>(common_part)), mean(static_cast<size_t>(dv));
  const double inv_n = 1.0 / static_cast<double>(N);
  for (int64_t bh = 0; bh < BH; ++bh) {
    float* st = stats + bh * stat_rows * m;
    if (dv) {
      std::fill(sums.begin(), sums.end(), 0.0f);
      std::fill(common.begin(), common.end(), 0.0);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = rhs_parts.data() + (bh * chunks + c) * rhs_part;
        for (int64_t e = 0; e < rhs_part; ++e) sums[e] += part[e];
        for (int64_t e = 0; e < common_part; ++e) common[e] += common_parts[(bh * chunks + c) * common_part + e];
      }
      const double row_sum = common[2 * dv];
      for (int64_t e = 0; e < dv; ++e) {
        mean[e] = common[dv + e] * inv_n;
        common[e] = (common[e] - row_sum * mean[e]) * inv_n;
      }
      const float* ones = sums.data() + m * dvp;
      float* out = rhs + bh * (m + 1) * dv;
      for (int64_t j = 0; j < m; ++j)
        for (int64_t e = 0; e < dv; ++e)
          out[j * dv + e] = static_cast<float>(
              (static_cast<double>(sums[j * dvp + e]) - static_cast<double>(ones[j]) * mean[e]) * inv_n + common[e]);
      for (int64_t e = 0; e < dv; ++e) out[m * dv + e] = static_cast<float>(mean[e]);
      for (int64_t j = 0; j < m; ++j)
        st[(stat_rows - 1) * m + j] = static_cast<float>((static_cast<double>(ones[j]) + row_sum) * inv_n);
    }
    if (!kernel.want_stats) continue;
    for (int64_t j = 0; j < m; ++j) {
      double s1 = 0.0, s2 = 0.0;
      for (int64_t c = 0; c < chunks; ++c) {
        s1 += stat_parts[(bh * chunks + c) * 2 * mp + j];
        s2 += stat_parts[(bh * chunks + c) * 2 * mp + mp + j];
      }
      const double off = s1 / static_cast<double>(N);
      st[j] = static_cast<float>(shift[bh * mp + j] + off);
      st[m + j] = static_cast<float>(std::max(s2 / static_cast<double>(N) - off * off, 0.0));
    }
  }
  return nullptr;
}

// AttentionApply ------------------------------------------------------------------------------

constexpr const char* kApply = "AttentionApply";

OrtStatus* create_apply(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** out) {
  Kernel kernel{def(op).isa};
  LAPF_TRY(read_flag(kApply, info, "centre", &kernel.centre));
  *out = new Kernel(kernel);
  return nullptr;
}

OrtStatus* compute_apply(void* op_kernel, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  Shape cs, as, bs;
  const float* c = nullptr;
  const float* a = nullptr;
  const float* bias = nullptr;
  LAPF_TRY(input(context, 0, &cs, &c));
  LAPF_TRY(input(context, 1, &as, &a));
  LAPF_TRY(input(context, 2, &bs, &bias));
  if (cs.dims.size() != 4 || as.dims.size() != 4 || bs.dims.size() != 4)
    return error(kApply, "rows (B, H, N, m), A (B, H, m, dv) and bias (B, H, 1, dv) must be 4-D");
  const int64_t B = cs.dims[0], H = cs.dims[1], N = cs.dims[2], m = cs.dims[3], dv = as.dims[3];
  if (as.dims[0] != B || as.dims[1] != H || as.dims[2] != m)
    return error(kApply, "A must be (B, H, m, dv) with B, H and m of rows (B, H, N, m)");
  if (bs.dims[0] != B || bs.dims[1] != H || bs.dims[2] != 1 || bs.dims[3] != dv)
    return error(kApply, "bias must be (B, H, 1, dv) with B, H of rows and dv of A");
  float* out = nullptr;
  LAPF_TRY(output(context, 0, {B, N, H, dv}, &out));
  const int64_t BH = B * H, dvp = padded(dv), chunks = chunks_of(N);
  if (BH == 0 || N == 0 || dv == 0) return nullptr;
  std::vector<float> ap(static_cast<size_t>(BH * m * dvp), 0.0f), bp(static_cast<size_t>(BH * dvp), 0.0f);
  for (int64_t bh = 0; bh < BH; ++bh) {
    for (int64_t e = 0; e < dv; ++e) bp[bh * dvp + e] = bias[bh * dv + e];
    for (int64_t k = 0; k < m; ++k)
      for (int64_t e = 0; e < dv; ++e) ap[(bh * m + k) * dvp + e] = a[(bh * m + k) * dv + e];
  }
  ApplyPass pass{c, ap.data(), bp.data(), out, H, N, m, dv, dvp, chunks, kernel.centre};
  const int64_t scratch = apply_scratch(dvp);
  auto task = [&](int64_t index) {
    const int64_t bh = head_major(index, H, chunks);
    kernel.isa.apply_chunk(pass, bh, (index / H) % chunks, thread_scratch(scratch));
  };
  return parallel_for(context, BH * chunks, task);
}

// The ops' definitions ------------------------------------------------------------------------

const char* op_name(const OrtCustomOp* op) { return def(op).name; }
const char* op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType op_type(const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
size_t op_input_count(const OrtCustomOp* op) { return def(op).inputs; }
size_t op_output_count(const OrtCustomOp* op) { return def(op).outputs; }
void op_destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
OrtCustomOpInputOutputCharacteristic op_required(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; }
OrtMemType op_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int op_one(const OrtCustomOp*) { return 1; }
int op_end_version(const OrtCustomOp*) { return INT_MAX; }

using CreateFn = OrtStatus* (*)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
using ComputeFn = OrtStatus* (*)(void*, OrtKernelContext*);

template <ComputeFn compute>
OrtStatus* guarded(void* kernel, OrtKernelContext* context) noexcept {
  try {
    return compute(kernel, context);
  } catch (const std::bad_alloc&) {
    return exception_status("lapformer_mm op library: out of memory");
  } catch (...) {
    return exception_status("lapformer_mm op library: unexpected C++ exception");
  }
}

OpDef make_op(const char* name, size_t inputs, size_t outputs, CreateFn create, ComputeFn compute,
              Isa isa) {
  OpDef d;
  std::memset(&d, 0, sizeof(d));
  OrtCustomOp& op = d.op;
  op.version = kApiVersion;
  op.GetName = op_name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = op_type;
  op.GetInputTypeCount = op_input_count;
  op.GetOutputType = op_type;
  op.GetOutputTypeCount = op_output_count;
  op.KernelDestroy = op_destroy;
  op.GetInputCharacteristic = op_required;
  op.GetOutputCharacteristic = op_required;
  op.GetInputMemoryType = op_memory;
  op.GetVariadicInputMinArity = op_one;
  op.GetVariadicInputHomogeneity = op_one;
  op.GetVariadicOutputMinArity = op_one;
  op.GetVariadicOutputHomogeneity = op_one;
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = op_one;
  op.GetEndVersion = op_end_version;
  d.name = name;
  d.inputs = inputs;
  d.outputs = outputs;
  d.isa = isa;
  return d;
}

#define LAPF_ISA_OF(isa) Isa{isa::kernel_rows, isa::rows_chunk, isa::apply_chunk}
#if defined(__x86_64__) || defined(_M_X64)
bool cpu_has_avx512() { return __builtin_cpu_supports("avx512f"); }
bool cpu_has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
const Isa kAvx512 = LAPF_ISA_OF(avx512);
const Isa kAvx2 = LAPF_ISA_OF(avx2);
#else
// Other CPUs get the generic build only (tools/build_ort_ops.py compiles no x86 kernels).
bool cpu_has_avx512() { return false; }
bool cpu_has_avx2() { return false; }
const Isa kAvx512 = LAPF_ISA_OF(generic);
const Isa kAvx2 = LAPF_ISA_OF(generic);
#endif
const Isa kGeneric = LAPF_ISA_OF(generic);

// The three ops with one build's kernels: a session registers one such set.
struct OpSet {
  OpDef ops[3];
};
OpSet op_set(Isa isa) {
  return OpSet{{make_op(kPairwise, 2, 1, create_pairwise, guarded<compute_pairwise>, isa),
                make_op(kRows, 3, 3, create_rows, guarded<compute_rows>, isa),
                make_op(kApply, 3, 1, create_apply, guarded<compute_apply>, isa)}};
}
enum Build { kGenericBuild, kAvx2Build, kAvx512Build, kBuilds };
const OpSet kOpSets[kBuilds] = {op_set(kGeneric), op_set(kAvx2), op_set(kAvx512)};

// The build for this CPU, or the one LAPFORMER_ORT_ISA asks for, read at each registration.
OrtStatus* choose_build(Build* build) {
  const char* env = std::getenv("LAPFORMER_ORT_ISA");
  std::string want = env && *env ? env : "auto";
  const char* library = "op library";
  if (want == "auto") {
    *build = cpu_has_avx512() ? kAvx512Build : cpu_has_avx2() ? kAvx2Build : kGenericBuild;
  } else if (want == "avx512") {
    if (!cpu_has_avx512()) return error(library, "LAPFORMER_ORT_ISA=avx512, but this CPU has no AVX-512F");
    *build = kAvx512Build;
  } else if (want == "avx2") {
    if (!cpu_has_avx2()) return error(library, "LAPFORMER_ORT_ISA=avx2, but this CPU has no AVX2 + FMA");
    *build = kAvx2Build;
  } else if (want == "default") {
    *build = kGenericBuild;
  } else {
    return error(library, "LAPFORMER_ORT_ISA='" + want + "' is not supported; allowed: auto, default, avx2, avx512");
  }
  return nullptr;
}

// One domain per build, made at the build's first registration and added to every session
// options registering it after (ONNX Runtime only reads a domain and keeps a pointer to it
// while the sessions live), so many sessions hold at most kBuilds domains. They are
// released when the library is unloaded, once no session can use them.
struct Domains {
  std::mutex mutex;
  OrtCustomOpDomain* of[kBuilds] = {};
  ~Domains() {
    for (OrtCustomOpDomain* domain : of)
      if (domain) g_api->ReleaseCustomOpDomain(domain);
  }
};
Domains g_domains;

// Called under g_domains.mutex.
OrtStatus* domain_of(Build build, OrtCustomOpDomain** out) {
  OrtCustomOpDomain*& cached = g_domains.of[build];
  if (!cached) {
    OrtCustomOpDomain* domain = nullptr;
    LAPF_TRY(g_api->CreateCustomOpDomain("lapformer_mm", &domain));
    for (const OpDef& op : kOpSets[build].ops) {
      if (OrtStatus* status = g_api->CustomOpDomain_Add(domain, &op.op)) {
        g_api->ReleaseCustomOpDomain(domain);
        return status;
      }
    }
    cached = domain;
  }
  *out = cached;
  return nullptr;
}

}  // namespace
}  // namespace lapf_ort

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace lapf_ort;
  const OrtApi* api = api_base->GetApi(kApiVersion);
  if (!api) {
    // Every release has version 1, enough to say why.
    const OrtApi* base = api_base->GetApi(1);
    return base ? base->CreateStatus(ORT_FAIL, "lapformer_mm op library: needs ONNX Runtime >= 1.17 (C API 17)")
                : nullptr;
  }
  std::lock_guard<std::mutex> lock(g_domains.mutex);
  // Written once: kernels of sessions already running read it.
  if (g_api != api) g_api = api;
  Build build = kGenericBuild;
  LAPF_TRY(choose_build(&build));
  OrtCustomOpDomain* domain = nullptr;
  LAPF_TRY(domain_of(build, &domain));
  return api->AddCustomOpDomain(options, domain);
}
