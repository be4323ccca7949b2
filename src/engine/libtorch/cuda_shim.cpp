// What tch does not expose of libtorch, as a few C functions for src/engine/libtorch/cuda.rs: TF32
// switches, a stream of its own per instance thread, CUDA events for timings (so an
// instance waits for its own stream, never for the whole device), and autocast on the CPU
// as well as on CUDA (tch's switch is CUDA's alone), and oneDNN Graph's fuser for the CPU. Only device-generic c10 headers: no CUDA headers are needed to build it, and
// on a machine without a GPU nothing here touches CUDA unless asked to.
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/jit/codegen/onednn/interface.h>

#include <cstring>
#include <exception>
#include <string>

namespace {
thread_local std::string last_error;

int fail(const std::exception& e) {
  last_error = e.what();
  return -1;
}

c10::Device cuda(int index) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
}
}  // namespace

extern "C" {

// The message of the calling thread's last failure (valid until its next call here).
const char* vg_last_error() { return last_error.c_str(); }

// Whether libtorch's CUDA half is registered: bit 0, CUDA's hooks (what libtorch asks
// about CUDA through; their stand-in says "not built"); bit 1, CUDA's device guard. Neither
// needs a GPU or the driver. Call only after libtorch_cuda.so had its chance to load: the
// hooks are looked up once.
int vg_cuda_registered() {
  return (at::detail::getCUDAHooks().isBuilt() ? 1 : 0) |
         (c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) ? 2 : 0);
}

// TF32 for cuDNN convolutions and cuBLAS matmuls, both at once.
int vg_set_allow_tf32(int allow) {
  try {
    at::globalContext().setAllowTF32CuDNN(allow != 0);
    at::globalContext().setAllowTF32CuBLAS(allow != 0);
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// 1 where cuDNN convolutions may use TF32, 0 where not; bit 1 the same for cuBLAS.
int vg_allow_tf32() {
  try {
    return (at::globalContext().allowTF32CuDNN() ? 1 : 0) |
           (at::globalContext().allowTF32CuBLAS() ? 2 : 0);
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// Makes a stream from libtorch's pool the calling thread's current stream on CUDA device
// `index`, so two instances on one GPU run side by side instead of taking turns on the
// default stream.
int vg_cuda_use_pool_stream(int index) {
  try {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.exchangeStream(impl.getStreamFromGlobalPool(cuda(index)));
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// Makes CUDA device `index` the calling thread's current device: where CUDA libraries that
// follow the current device (nvJPEG) put their work. libtorch's device guards restore it.
int vg_cuda_set_device(int index) {
  try {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.setDevice(cuda(index));
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// The calling thread's current stream on CUDA device `index`, as the cudaStream_t other
// CUDA libraries (nvJPEG) queue their work on (null is the default stream).
int vg_cuda_current_stream(int index, void** stream) {
  try {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    *stream = impl.getStream(cuda(index)).native_handle();
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// A CUDA event with timing, or null (vg_last_error says why).
void* vg_cuda_event_new() {
  try {
    return new c10::Event(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  } catch (const std::exception& e) {
    fail(e);
    return nullptr;
  }
}

void vg_cuda_event_free(void* event) { delete static_cast<c10::Event*>(event); }

// Records the event on the calling thread's current stream of device `index`.
int vg_cuda_event_record(void* event, int index) {
  try {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    static_cast<c10::Event*>(event)->record(impl.getStream(cuda(index)));
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// Waits until the work recorded before the event is done (that stream only).
int vg_cuda_event_synchronize(void* event) {
  try {
    static_cast<c10::Event*>(event)->synchronize();
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// Milliseconds from `start` to `end`, both recorded and done.
int vg_cuda_event_elapsed_ms(void* start, void* end, double* ms) {
  try {
    *ms = static_cast<c10::Event*>(start)->elapsedTime(*static_cast<c10::Event*>(end));
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// Autocast for the calling thread on the CPU (`cuda` 0) or CUDA (`cuda` 1), as
// torch.autocast's entry: eligible ops (convolutions, matmuls) in float16 (`precision` 1)
// or bfloat16 (2). `*previous` receives the state to give vg_autocast_exit: -1 when it was
// off, else the dtype it had.
int vg_autocast_enter(int cuda, int precision, int* previous) {
  try {
    auto device = cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
    *previous = at::autocast::is_autocast_enabled(device)
                    ? static_cast<int>(at::autocast::get_autocast_dtype(device))
                    : -1;
    at::autocast::set_autocast_dtype(device, precision == 1 ? at::kHalf : at::kBFloat16);
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::increment_nesting();
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// Puts back the state vg_autocast_enter found, and drops the casts autocast cached once
// the outermost autocast ends, as torch.autocast's exit does.
int vg_autocast_exit(int cuda, int previous) {
  try {
    auto device = cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
    if (previous >= 0) {
      at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(previous));
    }
    at::autocast::set_autocast_enabled(device, previous >= 0);
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// oneDNN Graph's fuser for TorchScript on the CPU (what torch.jit.enable_onednn_fusion
// sets): registered as a pass of the profiling executor, it runs on each graph the executor
// optimizes from then on. Process-wide.
int vg_set_onednn_fusion(int on) {
  try {
    torch::jit::RegisterLlgaFuseGraph::setEnabled(on != 0);
    return 0;
  } catch (const std::exception& e) {
    return fail(e);
  }
}

// 1 where oneDNN Graph's fuser is on (as this file last set it), else 0.
int vg_onednn_fusion() { return torch::jit::RegisterLlgaFuseGraph::isEnabled() ? 1 : 0; }

}  // extern "C"
