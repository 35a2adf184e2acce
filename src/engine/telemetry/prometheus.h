// PrometheusExporter: the latest step's metrics at http://<bind>:<port>/metrics in
// Prometheus's text exposition format (version 0.0.4), for a Prometheus server to scrape
// while the run trains. Rank 0 serves it ([metrics].prometheus_port).
//
// Every number of StepMetrics is a gauge named after its scalar tag (metrics_scalars):
// "train/loss" -> moetrain_train_loss, "moe/layer3/load_cv" -> moetrain_moe_load_cv{moe_layer="3"};
// a run label ([metrics].dir) on every sample tells runs apart. Served by cpp-httplib on a
// thread of its own; publish() swaps the page under a lock, so a scrape never waits for a
// step.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace httplib {
class Server;
}

namespace moetrain {

class PrometheusExporter {
 public:
  // Listens on `bind`:`port` (port 0: any free one, see port()). Throws naming the address
  // when it cannot (the port taken, say).
  PrometheusExporter(const std::string& bind, int port, const std::string& run);
  ~PrometheusExporter();
  PrometheusExporter(const PrometheusExporter&) = delete;
  PrometheusExporter& operator=(const PrometheusExporter&) = delete;

  // The page of step `step`'s metrics (metrics_scalars(m), computed once by the caller for
  // every sink).
  void publish(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  int port() const { return port_; }

 private:
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
  std::string run_;
  std::mutex mutex_;
  std::string page_;
};

// The exposition text of one step's metrics (labels: run, and moe_layer for per-layer ones).
std::string prometheus_text(int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
                            const std::string& run);

}  // namespace moetrain
