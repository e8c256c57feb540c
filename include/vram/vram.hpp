// vram/vram.hpp: everything in one include.
#pragma once

#include "vram/copy.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/pager_plan.hpp"
#include "vram/pending_work.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/size_classes.hpp"
#include "vram/stream_ordered_pool.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"
#include "vram/weight_pager.hpp"
