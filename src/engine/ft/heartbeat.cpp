#include "engine/ft/heartbeat.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/log.h"

namespace moetrain {

Heartbeat::Heartbeat() {
  const char* path = std::getenv("MOETRAIN_HEARTBEAT");
  if (path == nullptr || *path == '\0') return;
  fd_ = ::open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) spdlog::warn("heartbeat: cannot open {}: {} (the launcher cannot tell this rank is alive)", path,
                            std::strerror(errno));
}

Heartbeat::~Heartbeat() {
  if (fd_ >= 0) ::close(fd_);
}

void Heartbeat::beat() {
  if (fd_ >= 0) ::futimens(fd_, nullptr);  // both times to now
}

}  // namespace moetrain
