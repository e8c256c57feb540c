#include "bench/report.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>
#include <thread>

namespace vram::bench {
namespace {

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
          out += buffer;
        } else {
          out += c;
        }
    }
  }
  return out;
}

// Whole numbers below 2^53 print exactly (a size, a count); others with 4 digits.
bool whole(double value) {
  return std::isfinite(value) && value == std::floor(value) &&
         std::fabs(value) < 9007199254740992.0;
}

std::string brief(double value) {
  char buffer[32];
  if (whole(value) && std::fabs(value) >= 1e4) {
    std::snprintf(buffer, sizeof buffer, "%.0f", value);
  } else {
    std::snprintf(buffer, sizeof buffer, "%.4g", value);
  }
  return buffer;
}

// Decade tick labels: "1 ns", "10 ns", "100 ns", "1 us", ... "1 ms", "10 ms".
std::string duration_label(double ns) {
  const char* units[] = {"ns", "us", "ms", "s"};
  int unit = 0;
  while (ns >= 1000 && unit < 3) {
    ns /= 1000;
    ++unit;
  }
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g %s", ns, units[unit]);
  return buffer;
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else
      out += c;
  }
  return out;
}

bool better(const Measurement& a, const Measurement& b) {
  return a.lower_is_better ? a.value.median < b.value.median : a.value.median > b.value.median;
}

}  // namespace

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, whole(value) ? "%.0f" : "%.6g", value);
  return buffer;
}

std::string format_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  std::size_t value = bytes;
  while (value >= 1024 && value % 1024 == 0 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return std::to_string(value) + " " + units[unit];
}

const char* verdict_word(const Verdict& v) {
  if (v.ranges_overlap || (v.advantage >= 0.995 && v.advantage <= 1.005)) return "on par";
  return v.advantage > 1 ? "better" : "WORSE";
}

// The thread count of a parameter such as "16 threads" or "to 64 MiB, 16 threads"; 0 if none.
static std::size_t threads_of(const std::string& parameter) {
  const auto at = parameter.find(" threads");
  if (at == std::string::npos) return 0;
  auto start = at;
  while (start > 0 && std::isdigit(static_cast<unsigned char>(parameter[start - 1]))) --start;
  return start == at ? 0 : std::stoul(parameter.substr(start, at - start));
}

std::vector<Verdict> verdicts(const std::vector<Measurement>& results) {
  std::vector<Verdict> out;
  std::vector<std::pair<std::string, std::string>> keys;
  for (const auto& m : results) {
    auto key = std::make_pair(m.scenario, m.parameter);
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
  }
  for (const auto& [scenario, parameter] : keys) {
    const Measurement* best_ours = nullptr;
    const Measurement* best_peer = nullptr;
    for (const auto& m : results) {
      if (m.scenario != scenario || m.parameter != parameter || m.reference) continue;
      const Measurement*& slot = m.ours ? best_ours : best_peer;
      if (slot == nullptr || better(m, *slot)) slot = &m;
    }
    if (best_ours == nullptr || best_peer == nullptr) continue;
    Verdict v;
    v.scenario = scenario;
    v.parameter = parameter;
    v.ours = best_ours->allocator;
    v.ours_value = best_ours->value.median;
    v.best_peer = best_peer->allocator;
    v.peer_value = best_peer->value.median;
    v.unit = best_ours->unit;
    v.advantage =
        best_ours->lower_is_better ? v.peer_value / v.ours_value : v.ours_value / v.peer_value;
    v.ranges_overlap = best_ours->value.p10 <= best_peer->value.p90 &&
                       best_peer->value.p10 <= best_ours->value.p90;
    v.ours_samples = best_ours->value.samples;
    v.peer_samples = best_peer->value.samples;
    out.push_back(v);
  }
  return out;
}

void print_tables(std::FILE* out, const std::vector<Measurement>& results,
                  const std::vector<Verdict>& verdicts) {
  std::vector<std::string> scenarios;
  for (const auto& m : results) {
    if (std::find(scenarios.begin(), scenarios.end(), m.scenario) == scenarios.end()) {
      scenarios.push_back(m.scenario);
    }
  }
  const std::size_t cores = std::max(1U, std::thread::hardware_concurrency());
  for (const auto& scenario : scenarios) {
    std::fprintf(out, "\n== %s ==\n", scenario.c_str());
    std::fprintf(out, "%-22s %-34s %14s %24s %5s  %s\n", "parameter", "allocator", "median",
                 "p10 .. p90", "n", "notes");
    for (const auto& m : results) {
      if (m.scenario != scenario) continue;
      std::string notes;
      for (const auto& [key, value] : m.extra) notes += key + "=" + json_number(value) + " ";
      char spread[64];
      std::snprintf(spread, sizeof spread, "%.4g .. %.4g", m.value.p10, m.value.p90);
      const std::size_t threads = threads_of(m.parameter);
      if (threads > cores) notes += "(more threads than the " + std::to_string(cores) + " cores) ";
      std::fprintf(out, "%-22s %-34s %10.4g %-9s %18s %5zu  %s\n", m.parameter.c_str(),
                   (m.allocator + (m.ours ? " *" : "")).c_str(), m.value.median, m.unit.c_str(),
                   spread, m.value.samples, notes.c_str());
    }
    for (const auto& v : verdicts) {
      if (v.scenario != scenario) continue;
      std::fprintf(out, "verdict %s %s: %s %.4g %s vs best peer %s %.4g %s -> %.2fx %s%s\n",
                   v.scenario.c_str(), v.parameter.c_str(), v.ours.c_str(), v.ours_value,
                   v.unit.c_str(), v.best_peer.c_str(), v.peer_value, v.unit.c_str(),
                   v.advantage >= 1 ? v.advantage : 1 / v.advantage, verdict_word(v),
                   v.ranges_overlap ? " (p10..p90 ranges overlap)" : "");
    }
  }
  std::fprintf(out,
               "\n(* = vram; median and p10..p90 of n samples: timed batches after warm-up, or "
               "runs; a verdict is 'on par' when the ranges overlap)\n");
}

std::string to_json(const Environment& env, const std::vector<Measurement>& results,
                    const std::vector<Verdict>& verdicts) {
  std::ostringstream out;
  out << "{\n  \"tool\": \"vram bench\",\n";
  out << "  \"date\": \"" << json_escape(env.date) << "\",\n";
  out << "  \"git_commit\": \"" << json_escape(env.git_commit) << "\",\n";
  out << "  \"mode\": \"" << (env.gpu ? "gpu" : "host-only") << "\",\n";
  out << "  \"quick\": " << (env.quick ? "true" : "false") << ",\n";
  out << "  \"device\": {\"name\": \"" << json_escape(env.device_name) << "\", \"driver\": \""
      << json_escape(env.driver) << "\", \"runtime\": \"" << json_escape(env.runtime)
      << "\", \"no_gpu_reason\": \"" << json_escape(env.no_gpu_reason) << "\"},\n";
  out << "  \"results\": [";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& m = results[i];
    out << (i ? ",\n    " : "\n    ") << "{\"scenario\": \"" << json_escape(m.scenario)
        << "\", \"parameter\": \"" << json_escape(m.parameter)
        << "\", \"parameter_value\": " << json_number(m.parameter_value) << ", \"allocator\": \""
        << json_escape(m.allocator) << "\", \"ours\": " << (m.ours ? "true" : "false")
        << ", \"unit\": \"" << json_escape(m.unit)
        << "\", \"lower_is_better\": " << (m.lower_is_better ? "true" : "false")
        << ", \"median\": " << json_number(m.value.median)
        << ", \"p10\": " << json_number(m.value.p10) << ", \"p90\": " << json_number(m.value.p90)
        << ", \"samples\": " << m.value.samples << ", \"extra\": {";
    bool first = true;
    for (const auto& [key, value] : m.extra) {
      out << (first ? "" : ", ") << "\"" << json_escape(key) << "\": " << json_number(value);
      first = false;
    }
    out << "}}";
  }
  out << "\n  ],\n  \"verdicts\": [";
  for (std::size_t i = 0; i < verdicts.size(); ++i) {
    const auto& v = verdicts[i];
    out << (i ? ",\n    " : "\n    ") << "{\"scenario\": \"" << json_escape(v.scenario)
        << "\", \"parameter\": \"" << json_escape(v.parameter) << "\", \"ours\": \""
        << json_escape(v.ours) << "\", \"ours_value\": " << json_number(v.ours_value)
        << ", \"best_peer\": \"" << json_escape(v.best_peer)
        << "\", \"peer_value\": " << json_number(v.peer_value) << ", \"unit\": \""
        << json_escape(v.unit) << "\", \"advantage\": " << json_number(v.advantage) << "}";
  }
  out << "\n  ]\n}\n";
  return out.str();
}

std::string to_markdown(const Environment& env, const std::vector<Measurement>& results,
                        const std::vector<Verdict>& verdicts, const std::string& command) {
  std::ostringstream md;
  md << "Date " << env.date << ", " << env.device_name << ", driver (CUDA) " << env.driver
     << ", runtime " << env.runtime << ", commit " << env.git_commit
     << (env.gpu ? "" : ", host-only (no GPU)") << (env.quick ? ", --quick" : "") << ".\n"
     << "Command: `" << command << "`\n";
  std::vector<std::string> scenarios;
  for (const auto& m : results) {
    if (std::find(scenarios.begin(), scenarios.end(), m.scenario) == scenarios.end()) {
      scenarios.push_back(m.scenario);
    }
  }
  for (const auto& scenario : scenarios) {
    md << "\n### " << scenario
       << "\n\n| parameter | allocator | median | p10 .. p90 | n | notes |\n"
       << "|---|---|---|---|---|---|\n";
    for (const auto& m : results) {
      if (m.scenario != scenario) continue;
      std::string notes;
      for (const auto& [key, value] : m.extra) notes += key + "=" + brief(value) + " ";
      md << "| " << m.parameter << " | " << (m.ours ? "**" + m.allocator + "**" : m.allocator)
         << " | " << brief(m.value.median) << " " << m.unit << " | " << brief(m.value.p10) << " .. "
         << brief(m.value.p90) << " | " << m.value.samples << " | " << notes << "|\n";
    }
    for (const auto& v : verdicts) {
      if (v.scenario != scenario) continue;
      md << "\nVerdict " << v.parameter << ": " << v.ours << " " << brief(v.ours_value) << " "
         << v.unit << " vs best peer " << v.best_peer << " " << brief(v.peer_value) << " " << v.unit
         << ": **" << brief(v.advantage >= 1 ? v.advantage : 1 / v.advantage) << "x "
         << verdict_word(v) << "**" << (v.ranges_overlap ? " (p10..p90 ranges overlap)" : "")
         << "\n";
    }
  }
  return md.str();
}

std::string to_svg(const Environment& env, const std::vector<Measurement>& results) {
  std::vector<const Measurement*> pairs;
  std::vector<std::string> sizes;
  std::vector<std::string> allocators;
  for (const auto& m : results) {
    if (m.scenario != "pairs") continue;
    pairs.push_back(&m);
    if (std::find(sizes.begin(), sizes.end(), m.parameter) == sizes.end()) {
      sizes.push_back(m.parameter);
    }
    if (std::find(allocators.begin(), allocators.end(), m.allocator) == allocators.end()) {
      allocators.push_back(m.allocator);
    }
  }
  const int width = 980;
  const int height = 520;
  const int left = 80, right = 250, top = 60, bottom = 70;
  const int plot_w = width - left - right;
  const int plot_h = height - top - bottom;
  double low = 1, high = 10;
  for (const auto* m : pairs) {
    low = std::min(low, m->value.median);
    high = std::max(high, m->value.median);
  }
  const double log_low = std::floor(std::log10(std::max(low, 0.1)));
  const double log_high = std::ceil(std::log10(high));
  auto y_of = [&](double value) {
    const double t = (std::log10(std::max(value, 1e-3)) - log_low) / (log_high - log_low);
    return top + plot_h - t * plot_h;
  };
  const char* colors[] = {"#1b9e77", "#66a61e", "#d95f02", "#7570b3", "#e7298a", "#e6ab02"};
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << "<text x=\"" << left << "\" y=\"24\" font-size=\"16\" font-weight=\"bold\">"
      << "Warm allocate+free pair, time per pair (log scale, lower is better)</text>\n";
  svg << "<text x=\"" << left << "\" y=\"44\" fill=\"#555\">" << xml_escape(env.device_name)
      << ", driver " << xml_escape(env.driver) << ", " << xml_escape(env.date) << ", commit "
      << xml_escape(env.git_commit) << (env.gpu ? "" : " (host-only)") << "</text>\n";
  for (double d = log_low; d <= log_high + 1e-9; d += 1) {
    const double y = y_of(std::pow(10.0, d));
    svg << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << y << "\" y2=\""
        << y << "\" stroke=\"#ddd\"/>\n";
    svg << "<text x=\"" << left - 8 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">"
        << duration_label(std::pow(10.0, d)) << "</text>\n";
  }
  const double group_w = sizes.empty() ? plot_w : static_cast<double>(plot_w) / sizes.size();
  const double bar_w = allocators.empty() ? 10 : (group_w * 0.8) / allocators.size();
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    const double gx = left + g * group_w + group_w * 0.1;
    svg << "<text x=\"" << gx + group_w * 0.4 << "\" y=\"" << top + plot_h + 20
        << "\" text-anchor=\"middle\">" << xml_escape(sizes[g]) << "</text>\n";
    for (std::size_t a = 0; a < allocators.size(); ++a) {
      for (const auto* m : pairs) {
        if (m->parameter != sizes[g] || m->allocator != allocators[a]) continue;
        const double y = y_of(m->value.median);
        svg << "<rect x=\"" << gx + a * bar_w << "\" y=\"" << y << "\" width=\"" << bar_w - 2
            << "\" height=\"" << (top + plot_h) - y << "\" fill=\"" << colors[a % 6] << "\"><title>"
            << xml_escape(m->allocator) << " " << xml_escape(m->parameter) << ": "
            << json_number(m->value.median) << " ns</title></rect>\n";
      }
    }
  }
  svg << "<line x1=\"" << left << "\" x2=\"" << left << "\" y1=\"" << top << "\" y2=\""
      << top + plot_h << "\" stroke=\"#333\"/>\n";
  svg << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << top + plot_h
      << "\" y2=\"" << top + plot_h << "\" stroke=\"#333\"/>\n";
  svg << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 20
      << "\" text-anchor=\"middle\">request size</text>\n";
  for (std::size_t a = 0; a < allocators.size(); ++a) {
    const int y = top + 10 + static_cast<int>(a) * 22;
    svg << "<rect x=\"" << left + plot_w + 20 << "\" y=\"" << y
        << "\" width=\"14\" height=\"14\" fill=\"" << colors[a % 6] << "\"/>\n";
    svg << "<text x=\"" << left + plot_w + 40 << "\" y=\"" << y + 12 << "\">"
        << xml_escape(allocators[a]) << "</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

Measurement make_measurement(const std::string& scenario, const std::string& parameter,
                             double parameter_value, const std::string& allocator, bool ours,
                             const std::string& unit, bool lower_is_better,
                             const std::vector<double>& samples) {
  Measurement m;
  m.scenario = scenario;
  m.parameter = parameter;
  m.parameter_value = parameter_value;
  m.allocator = allocator;
  m.ours = ours;
  m.unit = unit;
  m.lower_is_better = lower_is_better;
  m.value = summarize(samples);
  return m;
}

}  // namespace vram::bench
