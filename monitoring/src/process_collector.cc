#include "treeverify/monitoring/process_collector.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace treeverify::monitoring {
namespace {

// /proc/self/stat's fields after the command (whose parentheses may hold spaces): field 3 (state)
// is element 0, so field n is element n - 3.
std::vector<std::string> StatFields() {
  std::ifstream in("/proc/self/stat");
  std::string line;
  std::getline(in, line);
  const size_t close = line.rfind(')');
  std::vector<std::string> fields;
  if (close == std::string::npos) return fields;
  std::istringstream rest(line.substr(close + 1));
  for (std::string field; rest >> field;) fields.push_back(field);
  return fields;
}

double Field(const std::vector<std::string>& fields, int n) {
  const size_t i = static_cast<size_t>(n - 3);
  return i < fields.size() ? std::stod(fields[i]) : 0.0;
}

// Seconds since the epoch at which the machine booted (/proc/stat's btime).
double BootTime() {
  std::ifstream in("/proc/stat");
  for (std::string key; in >> key;) {
    if (key == "btime") {
      double seconds = 0;
      in >> seconds;
      return seconds;
    }
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

prometheus::MetricFamily Family(const char* name, const char* help, prometheus::MetricType type,
                                double value) {
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return {name, help, type, {metric}};
}

}  // namespace

ProcessCollector::ProcessCollector() {
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  start_time_seconds_ = BootTime() + Field(StatFields(), 22) / ticks;  // starttime, in ticks
}

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  const std::vector<std::string> stat = StatFields();
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  const double cpu_seconds = (Field(stat, 14) + Field(stat, 15)) / ticks;  // utime + stime
  int64_t open_fds = 0;
  std::error_code error;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    ++open_fds;
  }
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  using prometheus::MetricType;
  return {
      Family("process_cpu_seconds_total", "Total user and system CPU time spent in seconds",
             MetricType::Counter, cpu_seconds),
      Family("process_resident_memory_bytes", "Resident memory size in bytes", MetricType::Gauge,
             Field(stat, 24) * page),
      Family("process_virtual_memory_bytes", "Virtual memory size in bytes", MetricType::Gauge,
             Field(stat, 23)),
      Family("process_open_fds", "Number of open file descriptors", MetricType::Gauge,
             static_cast<double>(open_fds)),
      Family("process_max_fds", "Maximum number of open file descriptors", MetricType::Gauge,
             static_cast<double>(files.rlim_cur)),
      Family("process_start_time_seconds", "Start time of the process since unix epoch in seconds",
             MetricType::Gauge, start_time_seconds_),
  };
}

}  // namespace treeverify::monitoring
