// ONNX Runtime's side of RegisterCustomOps, stubbed: loads the op library, registers it
// from four threads at once under the first LAPFORMER_ORT_ISA value given, then under
// each value in turn, and counts the custom-op domains the library creates, adds and releases.
// tests/deploy/test_ops.py::test_ort_op_library_shares_one_domain_per_build builds and runs
// it. Output, one line each: "registrations R", "created C", "distinct D" (domains added
// to session options), then, once the library's destructors have run (unloaded or at
// exit), "released N" and "double released N".
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "onnxruntime_c_api.h"

namespace {

struct Domain {
  std::atomic<bool> released{false};
};

std::atomic<int> g_created{0}, g_released{0}, g_double_released{0};
std::mutex g_mutex;
std::set<Domain*> g_added;
int g_registrations = 0;
OrtApi g_api{};

OrtStatus* ORT_API_CALL create_status(OrtErrorCode, const char* msg) NO_EXCEPTION {
  std::fprintf(stderr, "status: %s\n", msg);
  return reinterpret_cast<OrtStatus*>(1);
}
OrtStatus* ORT_API_CALL create_domain(const char*, OrtCustomOpDomain** out) NO_EXCEPTION {
  ++g_created;
  *out = reinterpret_cast<OrtCustomOpDomain*>(new Domain);
  return nullptr;
}
OrtStatus* ORT_API_CALL domain_add(OrtCustomOpDomain*, const OrtCustomOp*) NO_EXCEPTION { return nullptr; }
OrtStatus* ORT_API_CALL add_domain(OrtSessionOptions*, OrtCustomOpDomain* domain) NO_EXCEPTION {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_added.insert(reinterpret_cast<Domain*>(domain));
  return nullptr;
}
void ORT_API_CALL release_domain(OrtCustomOpDomain* domain) NO_EXCEPTION {
  // Not deleted: a second release of the same domain must show as such.
  if (reinterpret_cast<Domain*>(domain)->released.exchange(true)) ++g_double_released;
  ++g_released;
}
const OrtApi* ORT_API_CALL get_api(uint32_t) NO_EXCEPTION { return &g_api; }
const char* ORT_API_CALL get_version() NO_EXCEPTION { return "stub"; }
const OrtApiBase g_base{get_api, get_version};

using Register = OrtStatus*(ORT_API_CALL*)(OrtSessionOptions*, const OrtApiBase*);

void report_released() {
  std::printf("released %d\ndouble released %d\n", g_released.load(), g_double_released.load());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s LIBRARY ISA...\n", argv[0]);
    return 2;
  }
  g_api.CreateStatus = create_status;
  g_api.CreateCustomOpDomain = create_domain;
  g_api.CustomOpDomain_Add = domain_add;
  g_api.AddCustomOpDomain = add_domain;
  g_api.ReleaseCustomOpDomain = release_domain;
  // Registered before the library is loaded, so it runs after the library's destructors
  // even when dlclose leaves the library loaded until exit.
  std::atexit(report_released);
  void* handle = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  auto reg = reinterpret_cast<Register>(dlsym(handle, "RegisterCustomOps"));
  static int options_storage;  // never dereferenced
  auto options = reinterpret_cast<OrtSessionOptions*>(&options_storage);
  // Four threads at once under the first ISA, before any registration, then each in turn.
  setenv("LAPFORMER_ORT_ISA", argv[2], 1);
  std::vector<std::thread> threads;
  std::atomic<int> failed{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] { failed += reg(options, &g_base) != nullptr; });
  for (auto& thread : threads) thread.join();
  if (failed) return 1;
  g_registrations += 4;
  for (int i = 2; i < argc; ++i) {
    setenv("LAPFORMER_ORT_ISA", argv[i], 1);
    if (reg(options, &g_base)) return 1;
    ++g_registrations;
  }
  std::printf("registrations %d\ncreated %d\ndistinct %zu\n", g_registrations, g_created.load(),
              g_added.size());
  std::fflush(stdout);
  dlclose(handle);
  return 0;
}
