#include "replay/memory_svg.hpp"

#include <algorithm>
#include <cstdio>
#include <string_view>

namespace vram::replay {
namespace {

constexpr int kWidth = 1100;
constexpr int kPanelHeight = 300;
constexpr int kLeft = 80;    // room for the byte axis' labels
constexpr int kRight = 420;  // room for the legend
constexpr int kTop = 40;
constexpr int kBottom = 40;
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                   "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

std::string escaped(std::string_view text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string bytes_label(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  std::size_t unit = 0;
  while (bytes >= 1024.0 && unit + 1 < std::size(kUnits)) {
    bytes /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, bytes >= 10 || unit == 0 ? "%.0f %s" : "%.1f %s", bytes,
                kUnits[unit]);
  return text;
}

std::string format(const char* pattern, double a, double b) {
  char text[64];
  std::snprintf(text, sizeof text, pattern, a, b);
  return text;
}

}  // namespace

std::string memory_svg(const std::vector<TracePicture>& pictures) {
  const int height = static_cast<int>(pictures.size()) * (kPanelHeight + kTop + kBottom) + 10;
  std::string svg =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
      "width=\"" +
      std::to_string(kWidth) + "\" height=\"" + std::to_string(height) + "\" viewBox=\"0 0 " +
      std::to_string(kWidth) + " " + std::to_string(height) +
      "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  const int plot_width = kWidth - kLeft - kRight;
  for (std::size_t p = 0; p < pictures.size(); ++p) {
    const TracePicture& picture = pictures[p];
    const int top = static_cast<int>(p) * (kPanelHeight + kTop + kBottom) + kTop;
    std::size_t most = 1;
    for (const auto& series : picture.series) {
      for (const auto& s : series.samples) most = std::max({most, s.live_bytes, s.reserved_bytes});
    }
    const double events = static_cast<double>(std::max<std::size_t>(picture.events, 1));
    auto x = [&](std::size_t event) {
      return kLeft + static_cast<double>(event) / events * plot_width;
    };
    auto y = [&](std::size_t bytes) {
      return top + kPanelHeight -
             static_cast<double>(bytes) / static_cast<double>(most) * kPanelHeight;
    };
    svg += "<g class=\"trace\" data-trace=\"" + escaped(picture.trace) + "\">\n";
    svg += "<text x=\"" + std::to_string(kLeft) + "\" y=\"" + std::to_string(top - 12) +
           "\" font-size=\"14\" font-weight=\"bold\">" + escaped(picture.trace) +
           ": reserved (solid) and live (dashed) bytes over the trace's events</text>\n";
    // Axes, and byte ticks at quarters.
    svg += "<path d=\"M" + std::to_string(kLeft) + " " + std::to_string(top) + " V" +
           std::to_string(top + kPanelHeight) + " H" + std::to_string(kLeft + plot_width) +
           "\" stroke=\"black\" fill=\"none\"/>\n";
    svg += format("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">0</text>\n", kLeft - 6,
                  top + kPanelHeight + 4);
    for (int q = 1; q <= 4; ++q) {
      const std::size_t bytes = most * static_cast<std::size_t>(q) / 4;
      const double at = y(bytes);
      svg += format("<line x1=\"%.0f\" y1=\"%.1f\" ", kLeft, at) +
             format("x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", kLeft + plot_width, at);
      svg += format("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">", kLeft - 6, at + 4) +
             bytes_label(static_cast<double>(bytes)) + "</text>\n";
    }
    svg += "<text x=\"" + std::to_string(kLeft + plot_width / 2) + "\" y=\"" +
           std::to_string(top + kPanelHeight + 28) + "\" text-anchor=\"middle\">events (" +
           std::to_string(picture.events) + ")</text>\n";
    // The trace's live bytes (from the first series that has samples), then each allocator.
    for (const auto& series : picture.series) {
      if (series.samples.empty()) continue;
      svg +=
          "<polyline class=\"live\" fill=\"none\" stroke=\"black\" stroke-dasharray=\"4 3\" "
          "points=\"";
      for (const auto& s : series.samples) {
        svg += format("%.1f,%.1f ", x(s.event), y(s.live_bytes));
      }
      svg += "\"/>\n";
      break;
    }
    for (std::size_t a = 0; a < picture.series.size(); ++a) {
      const AllocatorSeries& series = picture.series[a];
      const char* color = kColors[a % std::size(kColors)];
      svg += "<polyline class=\"reserved\" data-allocator=\"" + escaped(series.allocator) +
             "\" fill=\"none\" stroke-width=\"1.5\" stroke=\"" + color + "\" points=\"";
      for (const auto& s : series.samples) {
        svg += format("%.1f,%.1f ", x(s.event), y(s.reserved_bytes));
      }
      svg += "\"/>\n";
      const int legend_y = top + 14 + static_cast<int>(a) * 18;
      svg += "<line x1=\"" + std::to_string(kLeft + plot_width + 16) + "\" y1=\"" +
             std::to_string(legend_y - 4) + "\" x2=\"" + std::to_string(kLeft + plot_width + 40) +
             "\" y2=\"" + std::to_string(legend_y - 4) + "\" stroke=\"" + color +
             "\" stroke-width=\"2\"/>\n";
      std::size_t peak = 0;
      for (const auto& s : series.samples) peak = std::max(peak, s.reserved_bytes);
      svg += "<text x=\"" + std::to_string(kLeft + plot_width + 46) + "\" y=\"" +
             std::to_string(legend_y) + "\">" + escaped(series.allocator) + " (peak " +
             bytes_label(static_cast<double>(peak)) + ")</text>\n";
    }
    const int live_y = top + 14 + static_cast<int>(picture.series.size()) * 18;
    svg += "<line x1=\"" + std::to_string(kLeft + plot_width + 16) + "\" y1=\"" +
           std::to_string(live_y - 4) + "\" x2=\"" + std::to_string(kLeft + plot_width + 40) +
           "\" y2=\"" + std::to_string(live_y - 4) +
           "\" stroke=\"black\" stroke-dasharray=\"4 3\"/>\n";
    svg += "<text x=\"" + std::to_string(kLeft + plot_width + 46) + "\" y=\"" +
           std::to_string(live_y) + "\">live (the trace's)</text>\n</g>\n";
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace vram::replay
