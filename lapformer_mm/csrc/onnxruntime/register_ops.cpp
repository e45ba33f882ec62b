// ONNX Runtime custom-operator library of lapformer_mm: the attention's kernel matrix as one
// node, lapformer_mm::PairwiseKernel(X (..., N, d), Y (..., M, d)) -> (..., N, M) =
// exp(-dist(x_i, y_j) / lam), attributes lam (float) and kind ('laplacian': l1 distance,
// 'gaussian': squared l2 distance), fp32.
//
// Built against ONNX Runtime's C API headers only: the library links nothing of ONNX
// Runtime, which hands it the API table in RegisterCustomOps, the one exported symbol. It
// asks GetApi for kApiVersion and calls nothing newer, and declares its OrtCustomOp at that
// version, so ONNX Runtime reads no field added later; one binary serves every release
// from 1.17 on.
//
// The instruction set is chosen when a session registers the library: AVX-512F, else
// AVX2 + FMA, else the generic build; LAPFORMER_ORT_ISA=default|avx2|avx512 forces one
// (the tests run each), and an unsupported request fails the registration with a message.
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "onnxruntime_c_api.h"
#include "ops.h"

namespace lapf_ort {
namespace {

// 1.17: KernelContext_ParallelFor (15), CreateKernelV2/KernelComputeV2 (16) and the
// custom op's start/end versions (17).
constexpr uint32_t kApiVersion = 17;
// Rows per parallel task: a fixed partition, so results do not depend on the thread count.
constexpr int64_t kChunkRows = 256;
// m is padded to whole vectors of the widest build.
constexpr int64_t kPadLanes = 16;

const OrtApi* g_api = nullptr;
using RowsFn = void (*)(const Problem&, int64_t, int64_t, int64_t);
RowsFn g_rows = nullptr;

OrtStatus* error(const std::string& message) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("lapformer_mm::PairwiseKernel: " + message).c_str());
}

#define LAPF_TRY(expr)              \
  do {                              \
    OrtStatus* status_ = (expr);    \
    if (status_) return status_;    \
  } while (0)

struct Kernel {
  float lam;
  bool l1;
};

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

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) {
  float lam = 0.0f;
  LAPF_TRY(g_api->KernelInfoGetAttribute_float(info, "lam", &lam));
  if (!(lam > 0.0f)) return error("attribute lam must be > 0, got " + std::to_string(lam));
  char kind[32] = {0};
  size_t size = sizeof(kind);
  LAPF_TRY(g_api->KernelInfoGetAttribute_string(info, "kind", kind, &size));
  std::string name(kind);
  if (name != "laplacian" && name != "gaussian")
    return error("attribute kind='" + name + "' is not supported; allowed: 'laplacian', 'gaussian'");
  *out = new Kernel{lam, name == "laplacian"};
  return nullptr;
}

struct Task {
  const Problem* problem;
  int64_t chunks_per_batch;
};

void run_task(void* data, size_t index) {
  const Task& task = *static_cast<const Task*>(data);
  const Problem& p = *task.problem;
  int64_t batch = static_cast<int64_t>(index) / task.chunks_per_batch;
  int64_t begin = (static_cast<int64_t>(index) % task.chunks_per_batch) * kChunkRows;
  int64_t end = begin + kChunkRows < p.n ? begin + kChunkRows : p.n;
  g_rows(p, batch, begin, end);
}

OrtStatus* compute(void* op_kernel, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<Kernel*>(op_kernel);
  const OrtValue* x_value = nullptr;
  const OrtValue* y_value = nullptr;
  LAPF_TRY(g_api->KernelContext_GetInput(context, 0, &x_value));
  LAPF_TRY(g_api->KernelContext_GetInput(context, 1, &y_value));
  Shape xs, ys;
  LAPF_TRY(shape_of(x_value, &xs));
  LAPF_TRY(shape_of(y_value, &ys));
  size_t rank = xs.dims.size();
  if (rank < 2 || ys.dims.size() != rank)
    return error("X and Y must have the same rank >= 2 (..., N, d) and (..., M, d)");
  for (size_t i = 0; i + 2 < rank; ++i)
    if (xs.dims[i] != ys.dims[i]) return error("X and Y must have the same leading dimensions");
  if (xs.dims[rank - 1] != ys.dims[rank - 1]) return error("X and Y must have the same last dimension d");
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) batch *= xs.dims[i];
  int64_t n = xs.dims[rank - 2], m = ys.dims[rank - 2], d = xs.dims[rank - 1];
  std::vector<int64_t> out_dims(xs.dims.begin(), xs.dims.end() - 1);
  out_dims.back() = n;
  out_dims.push_back(m);
  OrtValue* out_value = nullptr;
  LAPF_TRY(g_api->KernelContext_GetOutput(context, 0, out_dims.data(), out_dims.size(), &out_value));
  if (batch == 0 || n == 0 || m == 0) return nullptr;
  void* x_data = nullptr;
  void* y_data = nullptr;
  void* out_data = nullptr;
  // GetTensorMutableData on inputs: GetTensorData is newer than the API version asked for.
  LAPF_TRY(g_api->GetTensorMutableData(const_cast<OrtValue*>(x_value), &x_data));
  LAPF_TRY(g_api->GetTensorMutableData(const_cast<OrtValue*>(y_value), &y_data));
  LAPF_TRY(g_api->GetTensorMutableData(out_value, &out_data));
  int64_t padded = (m + kPadLanes - 1) / kPadLanes * kPadLanes;
  std::vector<float> yt(static_cast<size_t>(batch * d * padded), 0.0f);
  const float* y = static_cast<const float*>(y_data);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < m; ++j)
      for (int64_t k = 0; k < d; ++k) yt[(b * d + k) * padded + j] = y[(b * m + j) * d + k];
  Problem problem{static_cast<const float*>(x_data), yt.data(), static_cast<float*>(out_data),
                  n, m, d, padded, kernel.lam, kernel.l1};
  Task task{&problem, (n + kChunkRows - 1) / kChunkRows};
  return g_api->KernelContext_ParallelFor(context, run_task, static_cast<size_t>(batch * task.chunks_per_batch), 0,
                                          &task);
}

const char* op_name(const OrtCustomOp*) { return "PairwiseKernel"; }
const char* op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType op_type(const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
size_t op_input_count(const OrtCustomOp*) { return 2; }
size_t op_output_count(const OrtCustomOp*) { return 1; }
void op_destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
OrtCustomOpInputOutputCharacteristic op_required(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; }
OrtMemType op_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int op_one(const OrtCustomOp*) { return 1; }
int op_end_version(const OrtCustomOp*) { return INT_MAX; }

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
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
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = op_one;
  op.GetEndVersion = op_end_version;
  return op;
}

const OrtCustomOp g_op = make_op();

#if defined(__x86_64__) || defined(_M_X64)
bool cpu_has_avx512() { return __builtin_cpu_supports("avx512f"); }
bool cpu_has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
const RowsFn kAvx512 = avx512::kernel_rows;
const RowsFn kAvx2 = avx2::kernel_rows;
#else
// Other CPUs get the generic build only (tools/build_ort_ops.py compiles no x86 kernels).
bool cpu_has_avx512() { return false; }
bool cpu_has_avx2() { return false; }
const RowsFn kAvx512 = generic::kernel_rows;
const RowsFn kAvx2 = generic::kernel_rows;
#endif

OrtStatus* choose_isa() {
  const char* env = std::getenv("LAPFORMER_ORT_ISA");
  std::string want = env && *env ? env : "auto";
  if (want == "auto") {
    g_rows = cpu_has_avx512() ? kAvx512 : cpu_has_avx2() ? kAvx2 : generic::kernel_rows;
  } else if (want == "avx512") {
    if (!cpu_has_avx512()) return error("LAPFORMER_ORT_ISA=avx512, but this CPU has no AVX-512F");
    g_rows = kAvx512;
  } else if (want == "avx2") {
    if (!cpu_has_avx2()) return error("LAPFORMER_ORT_ISA=avx2, but this CPU has no AVX2 + FMA");
    g_rows = kAvx2;
  } else if (want == "default") {
    g_rows = generic::kernel_rows;
  } else {
    return error("LAPFORMER_ORT_ISA='" + want + "' is not supported; allowed: auto, default, avx2, avx512");
  }
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
  g_api = api;
  LAPF_TRY(choose_isa());
  OrtCustomOpDomain* domain = nullptr;
  LAPF_TRY(api->CreateCustomOpDomain("lapformer_mm", &domain));
  // The domain is not released: ONNX Runtime keeps a pointer to it for the session's life.
  LAPF_TRY(api->CustomOpDomain_Add(domain, &g_op));
  return api->AddCustomOpDomain(options, domain);
}
