// Which device holds which (group, rank) slot of a communicator.
//
// A communicator covers every tensor-parallel group of a mesh axis at once: slot
// `group * group_size + rank` belongs to the device at that position of the mesh (the
// axis last). The SPMD program is the same on every device, so a handler finds its own
// slot from the device ordinal XLA gives it.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "protocol/status.h"

namespace jax_ub {

constexpr int kMaxRanks = 64;

class Topology {
 public:
  // slot_devices[slot] is the local device ordinal of that slot, or -1 when the slot
  // lives in another process.
  static Status Make(int group_size, std::vector<int> slot_devices, Topology* out) {
    if (group_size < 1 || group_size > kMaxRanks)
      return InvalidArgument("group size " + std::to_string(group_size) + " is not in [1, " +
                             std::to_string(kMaxRanks) + "]");
    if (slot_devices.empty() || slot_devices.size() % group_size != 0)
      return InvalidArgument("number of slots " + std::to_string(slot_devices.size()) +
                             " is not a positive multiple of the group size " +
                             std::to_string(group_size));
    Topology t;
    t.group_size_ = group_size;
    t.slot_devices_ = std::move(slot_devices);
    for (int s = 0; s < static_cast<int>(t.slot_devices_.size()); ++s) {
      int d = t.slot_devices_[s];
      if (d < 0) continue;
      if (!t.slot_of_device_.emplace(d, s).second)
        return InvalidArgument("device " + std::to_string(d) + " appears twice in the mesh");
    }
    *out = std::move(t);
    return Status::Ok();
  }

  int group_size() const { return group_size_; }
  int num_slots() const { return static_cast<int>(slot_devices_.size()); }
  int device_of(int slot) const { return slot_devices_[slot]; }
  bool is_local(int slot) const { return slot_devices_[slot] >= 0; }
  int group_of(int slot) const { return slot / group_size_; }
  int rank_of(int slot) const { return slot % group_size_; }
  int slot(int group, int rank) const { return group * group_size_ + rank; }

  // The slot a handler running on `device` owns, or an error naming the device.
  Status SlotOfDevice(int device, int* slot) const {
    auto it = slot_of_device_.find(device);
    if (it == slot_of_device_.end())
      return FailedPrecondition("device ordinal " + std::to_string(device) +
                                " is not part of this communicator's mesh; was the op "
                                "run on a different mesh than the one it was created for?");
    *slot = it->second;
    return Status::Ok();
  }

 private:
  int group_size_ = 0;
  std::vector<int> slot_devices_;
  std::unordered_map<int, int> slot_of_device_;
};

}  // namespace jax_ub
