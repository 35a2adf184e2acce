#include "engine/telemetry/prometheus.h"

#include <fmt/format.h>
#include <httplib.h>

#include <chrono>
#include <cmath>
#include <map>
#include <vector>

#include "core/error.h"

namespace moetrain {
namespace {

// Label values escape backslash, double quote and newline.
std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// "moe/layer3/load_cv" -> {"moetrain_moe_load_cv", "3"}; "train/loss" -> {"moetrain_train_loss", ""}.
std::pair<std::string, std::string> metric_name(const std::string& tag) {
  std::string layer, name = "moetrain_";
  size_t at = 0;
  while (at <= tag.size()) {
    const size_t end = std::min(tag.find('/', at), tag.size());
    const std::string part = tag.substr(at, end - at);
    if (part.rfind("layer", 0) == 0 && part.size() > 5 && part.find_first_not_of("0123456789", 5) == std::string::npos) {
      layer = part.substr(5);
    } else {
      if (name.size() > 9) name += '_';
      for (char c : part) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    }
    at = end + 1;
  }
  return {name, layer};
}

}  // namespace

std::string prometheus_text(int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
                            const std::string& run) {
  // Samples grouped by metric name (one HELP/TYPE block each), in first-seen order.
  std::vector<std::string> order;
  std::map<std::string, std::vector<std::string>> samples;
  std::vector<std::pair<std::string, double>> values{{"train/step", static_cast<double>(step)}};
  values.insert(values.end(), scalars.begin(), scalars.end());
  const std::string run_label = fmt::format("run=\"{}\"", escape_label(run));
  for (const auto& [tag, v] : values) {
    const auto [name, layer] = metric_name(tag);
    if (!samples.count(name)) order.push_back(name);
    const std::string labels = layer.empty() ? run_label : fmt::format("{},moe_layer=\"{}\"", run_label, layer);
    const std::string value = std::isnan(v) ? "NaN" : std::isinf(v) ? (v > 0 ? "+Inf" : "-Inf") : fmt::format("{}", v);
    samples[name].push_back(fmt::format("{}{{{}}} {}", name, labels, value));
  }
  std::string out;
  for (const std::string& name : order) {
    out += fmt::format("# HELP {} moetrain metric (see metrics_scalars)\n# TYPE {} gauge\n", name, name);
    for (const std::string& s : samples[name]) out += s + "\n";
  }
  return out;
}

PrometheusExporter::PrometheusExporter(const std::string& bind, int port, const std::string& run)
    : server_(std::make_unique<httplib::Server>()), run_(run) {
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a second run on
  // this machine share the port (each scrape answered by either) instead of failing.
  server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mutex_);
    res.set_content(page_, "text/plain; version=0.0.4; charset=utf-8");
  });
  if (port == 0) {
    port_ = server_->bind_to_any_port(bind);
    MT_CHECK(port_ > 0, "metrics: cannot listen for Prometheus on {} (any port)", bind);
  } else {
    MT_CHECK(server_->bind_to_port(bind, port),
             "metrics: cannot listen for Prometheus on {}:{} ([metrics].prometheus_port): in use, or not an "
             "address of this machine",
             bind, port);
    port_ = port;
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  // stop() does nothing until the server runs: wait for it, so that a quick destruction
  // cannot leave the thread listening for ever.
  while (!server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

PrometheusExporter::~PrometheusExporter() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void PrometheusExporter::publish(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  std::string page = prometheus_text(step, scalars, run_);
  std::lock_guard<std::mutex> lock(mutex_);
  page_ = std::move(page);
}

}  // namespace moetrain
