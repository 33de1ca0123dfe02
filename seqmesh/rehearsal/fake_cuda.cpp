// seqmesh rehearse: a CUDA device guard and CUDA hooks that do nothing, so that fake CUDA tensors run autograd
// in a CPU build of torch. Preloaded (LD_PRELOAD) into the rehearsal's own process only: see cuda_library.py.
// Built with SEQMESH_GUARD_ONLY for a CUDA build of torch on a machine without a usable GPU: the guard alone, put in
// place and taken back by the rehearsal (the two extern "C" functions below).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
constexpr auto kCuda = c10::DeviceType::CUDA;

struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kCuda; }
  Device exchangeDevice(Device) const override { return Device(kCuda, 0); }
  Device getDevice() const override { return Device(kCuda, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  Stream getDefaultStream(Device) const override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  Stream getNewStream(Device, int) const override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
  double elapsedTime(void*, void*, const DeviceIndex) const override { return 0.0; }
};

const FakeCudaGuard fake_cuda_guard;

struct FakeCudaHooks : at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};
static_assert(sizeof(FakeCudaHooks) == sizeof(at::CUDAHooksInterface), "the hooks hold no data of their own");

#ifndef SEQMESH_GUARD_ONLY
// A CPU build: loaded before torch's Python module (LD_PRELOAD), so torch finds these on its first look.
struct Install {
  Install() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(kCuda)];
    const c10::impl::DeviceGuardImplInterface* none = nullptr;
    slot.compare_exchange_strong(none, &fake_cuda_guard);
  }
} install;
#endif
}  // namespace

#ifdef SEQMESH_GUARD_ONLY
// A CUDA build on a machine without a usable GPU: torch's own guard and hooks are registered already, and both ask
// the driver (autograd asks the hooks whether each device has a context). While the rehearsal runs, the registry
// holds this guard and torch's hooks object answers as FakeCudaHooks: the object's virtual table is swapped for
// FakeCudaHooks' (both derive from CUDAHooksInterface alone and hold no data, so the layout is the same). Both
// are put back by seqmesh_restore_cuda_guard.
extern "C" {
static const c10::impl::DeviceGuardImplInterface* saved_guard = nullptr;
static const void* saved_hooks_table = nullptr;
static bool installed = false;  // what is saved is torch's own only while one install is in place

static void** hooks_table_slot() {
  return reinterpret_cast<void**>(const_cast<at::CUDAHooksInterface*>(&at::detail::getCUDAHooks()));
}

// 0 once installed; 1, changing nothing, where an install is in place already
int seqmesh_install_fake_cuda_guard() {
  static const FakeCudaHooks model{at::CUDAHooksArgs{}};
  if (installed) return 1;
  installed = true;
  saved_guard = c10::impl::device_guard_impl_registry[static_cast<size_t>(kCuda)].exchange(&fake_cuda_guard);
  saved_hooks_table = *hooks_table_slot();
  *hooks_table_slot() = *reinterpret_cast<void* const*>(&model);
  return 0;
}

void seqmesh_restore_cuda_guard() {
  if (!installed) return;
  installed = false;
  *hooks_table_slot() = const_cast<void*>(saved_hooks_table);
  c10::impl::device_guard_impl_registry[static_cast<size_t>(kCuda)].store(saved_guard);
}
}
#else
namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks)
}
#endif
