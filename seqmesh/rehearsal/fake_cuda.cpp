// seqmesh rehearse: a CUDA device guard and CUDA hooks that do nothing, so that fake CUDA tensors run autograd
// in a CPU build of torch. Preloaded (LD_PRELOAD) into the rehearsal's own process only: see workarounds.py.
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

struct FakeCudaHooks : at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};

const FakeCudaGuard fake_cuda_guard;

// Loaded before torch's Python module (LD_PRELOAD), so torch finds these on its first look.
struct Install {
  Install() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(kCuda)];
    const c10::impl::DeviceGuardImplInterface* none = nullptr;
    slot.compare_exchange_strong(none, &fake_cuda_guard);
  }
} install;
}  // namespace

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks)
}
