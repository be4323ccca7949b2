// libtorch's AOTInductor package loader (torch.export packages, `.pt2`) as a few C functions
// for src/engine/libtorch/aoti.rs: load an unpacked package onto a device, run it on one tensor, free
// it. Errors are c10's short messages (no C++ backtrace), kept per thread.
#include <ATen/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/headeronly/version.h>

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MFD_EXEC
#define MFD_EXEC 0x0010U
#endif

#include <cerrno>
#include <cstring>

#include <exception>
#include <mutex>
#include <string>

namespace {
thread_local std::string aoti_error;

// The name AOTInductor gives the model inside every package it writes (aoti.rs: MODEL).
const char* const kModel = "model";

template <typename F>
auto guarded(F&& f, decltype(f()) failed) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    aoti_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    aoti_error = e.what();
  } catch (...) {
    aoti_error = "an unknown C++ exception";
  }
  return failed;
}

// A package's compiled model names libtorch.so (beside libtorch_cpu.so, which the binary
// links) without a path to find it by. That library only pulls in libtorch_cpu and
// libtorch_cuda; the binary does not link it. `stub` (an empty library whose soname is
// libtorch.so) is opened once, from memory, so the dynamic loader finds that name among
// the loaded objects. Returns "" or why it failed.
std::string open_libtorch_stub(const unsigned char* stub, size_t len) {
  static std::once_flag once;
  static std::string why;
  std::call_once(once, [&] {
    // Executable where the kernel asks memfds to say so (vm.memfd_noexec); kernels before
    // 6.3 do not know the flag, and every memfd is executable there.
    int fd = memfd_create("libtorch.so", MFD_CLOEXEC | MFD_EXEC);
    if (fd < 0 && errno == EINVAL) fd = memfd_create("libtorch.so", MFD_CLOEXEC);
    if (fd < 0) {
      why = std::string("memfd_create: ") + std::strerror(errno);
      return;
    }
    size_t done = 0;
    while (done < len) {
      ssize_t n = write(fd, stub + done, len - done);
      if (n <= 0) {
        why = std::string("writing the libtorch.so stub: ") + std::strerror(errno);
        close(fd);
        return;
      }
      done += static_cast<size_t>(n);
    }
    std::string path = "/proc/self/fd/" + std::to_string(fd);
    // Kept open for the life of the process, as the package loaders are.
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* e = dlerror();
      why = std::string("the libtorch.so stub did not load: ") + (e ? e : "unknown error");
    }
    close(fd);
  });
  return why;
}
}  // namespace

extern "C" {

// The calling thread's last failure here (valid until its next call).
const char* vg_aoti_last_error() { return aoti_error.c_str(); }

// The libtorch version this binary runs on ("2.13.0").
const char* vg_torch_version() { return TORCH_VERSION; }

// The package's model, from the directory it was unpacked into (`path`; see
// src/engine/libtorch/package.rs), loaded onto CUDA device `device_index`, or the CPU (-1); null on
// failure. One runner: the instance thread that owns it runs one batch at a time.
// `stub`: the libtorch.so stub's bytes (see open_libtorch_stub).
// One load at a time in the process: libtorch's loader reads each package's JSON files into
// one static object, so two loads at once raced (one saw no metadata, "No device
// information found.", or the process crashed). Runs and frees need no such lock.
void* vg_aoti_load(const char* path, int device_index, const unsigned char* stub, size_t stub_len) {
  static std::mutex loading;
  std::lock_guard<std::mutex> one_at_a_time(loading);
  return guarded(
      [&]() -> void* {
        std::string why = open_libtorch_stub(stub, stub_len);
        if (!why.empty()) {
          aoti_error = why;
          return nullptr;
        }
        return new torch::inductor::AOTIModelPackageLoader(
            path, kModel, false, 1, static_cast<c10::DeviceIndex>(device_index));
      },
      nullptr);
}

void vg_aoti_free(void* package) {
  delete static_cast<torch::inductor::AOTIModelPackageLoader*>(package);
}

// The model's one output for `input` (on the model's device; the current stream of that
// device on a GPU), as a new tensor the caller frees; null on failure or when the model
// returns other than one tensor.
at::Tensor* vg_aoti_run(void* package, const at::Tensor* input) {
  return guarded(
      [&]() -> at::Tensor* {
        auto* loader = static_cast<torch::inductor::AOTIModelPackageLoader*>(package);
        // The model runs on the current stream of the current device: on a GPU, the input's
        // device, whose current stream on this thread is its instance's own.
        c10::DeviceGuard device(input->device());
        std::vector<at::Tensor> outputs = loader->run({*input});
        if (outputs.size() != 1) {
          aoti_error = "the package's model returned " + std::to_string(outputs.size()) +
                       " tensors; a classifier returns one";
          return nullptr;
        }
        return new at::Tensor(std::move(outputs[0]));
      },
      nullptr);
}
}
