// The CUDA backend's entry points in a build without CUDA (no nvcc at configure time): the model
// refuses --device cuda with one line that says why.
#include "bitdelta/error.h"
#include "device_model.h"

namespace bitdelta::cuda {

namespace {
constexpr const char* kWhy = "this build has no CUDA backend (nvcc was not found when it was configured)";
}

std::string unavailable_reason() { return kWhy; }

struct DeviceModel::Impl {};

DeviceModel::DeviceModel(const ModelConfig&, const VariantWeights&, std::span<const float>, const DeviceOptions&) {
  fail("--device cuda: ", kWhy);
}
DeviceModel::~DeviceModel() = default;
std::shared_ptr<DeviceVariant> DeviceModel::upload(const VariantWeights&, const DeltaFile&, UploadStats*) const {
  fail(kWhy);
}
void DeviceModel::install(int, std::shared_ptr<DeviceVariant>) { fail(kWhy); }
void DeviceModel::remove(int) {}
std::vector<float> DeviceModel::forward(std::span<const DeviceRow>) { fail(kWhy); }
std::shared_ptr<DeviceKV> DeviceModel::clone_kv(const DeviceKV&, size_t) const {
  fail(kWhy);
}
uint64_t DeviceModel::kv_bytes(const DeviceKV&) const {
  return 0;
}
GraphStats DeviceModel::graph_stats() const { return {}; }
DeviceMemory DeviceModel::memory() const { return {}; }
std::string DeviceModel::device_name() const { return ""; }

}  // namespace bitdelta::cuda
