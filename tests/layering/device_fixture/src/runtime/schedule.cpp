// Fixture of the device-assumption check: the first two mentions must be reported, the others pass.
at::Tensor shard(const at::Tensor& x) { return x.cpu(); }
bool local(const at::Tensor& x) { return x.device().is_cpu(); }
at::Tensor index(const std::vector<int64_t>& v) { return at::tensor(v).to(c10::kCPU); }  // device: host metadata
// device: the CPU kernel's row split
const bool own_rows = device == c10::DeviceType::CPU;
