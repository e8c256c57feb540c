// vram/detail/pointer_map.hpp: a flat map from non-null pointers to non-null pointers
// (open addressing, linear probing, backward-shift deletion: no tombstones, no node per
// entry). Growing is the only step that allocates: reserve_one() before a change makes the
// following insert() unable to fail, so a caller can stay exception-safe.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace vram::detail {

template <class Value>
class PointerMap {
 public:
  PointerMap() = default;
  PointerMap(const PointerMap&) = delete;
  PointerMap& operator=(const PointerMap&) = delete;

  std::size_t size() const noexcept { return size_; }

  // Room for one more entry (doubling the table when the load would pass 1/2); throws
  // std::bad_alloc with nothing changed.
  void reserve_one() {
    if ((size_ + 1) * 2 <= capacity()) return;
    const std::size_t bits = slots_ == nullptr ? 4 : bits_ + 1;
    auto grown = std::make_unique<Slot[]>(std::size_t{1} << bits);  // zeroed: all empty
    const std::size_t old_capacity = capacity();
    std::unique_ptr<Slot[]> old = std::move(slots_);
    slots_ = std::move(grown);
    bits_ = bits;
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != nullptr) place(old[i].key, old[i].value);
    }
  }
  // `key` must not be present; reserve_one() must have been called since the last insert.
  void insert(const void* key, Value* value) noexcept { place(key, value), ++size_; }
  // The null key is never present (an empty slot's key is null): find and erase answer null
  // for it and change nothing.
  Value* find(const void* key) const noexcept {
    if (slots_ == nullptr || key == nullptr) return nullptr;
    for (std::size_t i = home(key);; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return slots_[i].value;
      if (slots_[i].key == nullptr) return nullptr;
    }
  }
  // Removes `key`; returns its value, null when absent.
  Value* erase(const void* key) noexcept {
    return erase_if(key, [](const Value*) { return true; });
  }
  // Removes `key` when `keep_out(value)` says so; returns its value then, else null.
  template <class Predicate>
  Value* erase_if(const void* key, Predicate keep_out) noexcept {
    if (slots_ == nullptr || key == nullptr) return nullptr;
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == nullptr) return nullptr;
    }
    Value* value = slots_[i].value;
    if (!keep_out(static_cast<const Value*>(value))) return nullptr;
    // Backward shift: move later entries of the probe run into the hole when their home
    // does not lie (cyclically) after the hole.
    for (std::size_t j = (i + 1) & mask();; j = (j + 1) & mask()) {
      if (slots_[j].key == nullptr) break;
      const std::size_t h = home(slots_[j].key);
      if (((j - h) & mask()) >= ((j - i) & mask())) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
    return value;
  }

 private:
  struct Slot {
    const void* key = nullptr;
    Value* value = nullptr;
  };
  std::size_t capacity() const noexcept { return slots_ == nullptr ? 0 : std::size_t{1} << bits_; }
  std::size_t mask() const noexcept { return capacity() - 1; }
  // Fibonacci hashing of the address: blocks are aligned, so the low bits carry little.
  std::size_t home(const void* key) const noexcept {
    const auto k = reinterpret_cast<std::uintptr_t>(key);
    return static_cast<std::size_t>((k * 0x9E3779B97F4A7C15ull) >> (64 - bits_));
  }
  void place(const void* key, Value* value) noexcept {
    std::size_t i = home(key);
    while (slots_[i].key != nullptr) i = (i + 1) & mask();
    slots_[i] = Slot{key, value};
  }

  std::unique_ptr<Slot[]> slots_;
  std::size_t bits_ = 0;
  std::size_t size_ = 0;
};

}  // namespace vram::detail
