// The plug-in's sleep and wake (sleep_regions.hpp) over each device's DevicePool.
#include "sleep_regions.hpp"

#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "device_registry.hpp"
#include "errors.hpp"
#include "vram/device_pool.hpp"

namespace vram_torch {
namespace {

constexpr std::size_t kMaxTagName = 256;

thread_local std::vector<vram::DevicePool::TagScope> tl_regions;

// The tag's name, or null (said as the latest error) when it is null, empty or too long.
const char* checked_name(const char* tag, const char* call) noexcept {
  if (tag == nullptr || tag[0] == '\0' || strnlen(tag, kMaxTagName + 1) > kMaxTagName) {
    note_error_built(
        [&] {
          return std::string(call) + ": the tag name must be a non-empty string of at most 256 " +
                 "bytes";
        },
        false);
    return nullptr;
  }
  return tag;
}

template <typename Fn>
int each_device_with(const char* tag, int device, const char* call, Fn&& fn) noexcept {
  if (checked_name(tag, call) == nullptr) return -1;
  try {
    int found = 0;
    const int status = for_each_state(device, [&](DeviceState& state) {
      if (const auto handle = state.pool.find_tag(tag)) {
        ++found;
        fn(state.pool, *handle);
      }
    });
    if (status != 0) {
      note_error_built([&] { return std::string(call) + ": no device " + std::to_string(device); },
                       false);
      return -1;
    }
    if (found == 0) {
      note_error_built(
          [&] {
            return std::string(call) + ": no region named '" + tag + "' on " +
                   (device < 0 ? std::string("any device") : "device " + std::to_string(device)) +
                   " (a tag is made by the first region() that names it)";
          },
          false);
      return -1;
    }
    return 0;
  } catch (const std::exception& e) {
    note_error_built([&] { return std::string(call) + "('" + tag + "'): " + e.what(); }, false);
    return -1;
  } catch (...) {
    note_error_built([&] { return std::string(call) + "('" + tag + "'): unknown error"; }, false);
    return -1;
  }
}

}  // namespace

int region_enter(const char* tag, int discardable, int device) noexcept {
  if (checked_name(tag, "region") == nullptr) return -1;
  try {
    DeviceState& state = state_for(device);
    auto handle = state.pool.find_tag(tag);
    if (!handle) {
      vram::SleepTagOptions options;
      options.discardable = discardable != 0;
      handle = state.pool.create_tag(tag, options);
    } else if (state.pool.tag_stats(*handle).discardable != (discardable != 0)) {
      note_error_built(
          [&] {
            return std::string("region('") + tag +
                   "'): the tag exists with discardable=" + (discardable != 0 ? "False" : "True") +
                   "; a tag keeps its kind";
          },
          false);
      return -1;
    }
    tl_regions.reserve(tl_regions.size() + 1);
    tl_regions.push_back(state.pool.tag_scope(*handle));
    return 0;
  } catch (const std::exception& e) {
    note_error_built(
        [&] {
          return std::string("region('") + tag + "') on device " + std::to_string(device) + ": " +
                 e.what();
        },
        false);
    return -1;
  } catch (...) {
    note_error_built([&] { return std::string("region('") + tag + "'): unknown error"; }, false);
    return -1;
  }
}

int region_exit() noexcept {
  if (tl_regions.empty()) {
    note_error("region exit: this thread has no open region", false);
    return -1;
  }
  tl_regions.pop_back();  // its scope ends: the enclosing one (if any) routes again
  return 0;
}

int sleep_tag(const char* tag, int device, cudaStream_t stream, bool discard) noexcept {
  return each_device_with(tag, device, "sleep", [&](vram::DevicePool& pool, vram::SleepTag handle) {
    pool.sleep(handle, stream, discard ? vram::SleepContents::discard : vram::SleepContents::keep);
  });
}

int wake_tag(const char* tag, int device, cudaStream_t stream) noexcept {
  return each_device_with(tag, device, "wake", [&](vram::DevicePool& pool, vram::SleepTag handle) {
    pool.wake(handle, stream);
  });
}

}  // namespace vram_torch
