// How ranks find each other: an all-gather of small byte strings. Everything a
// Buffer exchanges at start-up (device ids, host ids, memory handles) goes
// through this one call, so any launcher can provide it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace turnout {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank passes the same number of bytes; returns size() * mine.size()
  // bytes, rank 0's first.
  virtual std::vector<std::byte> all_gather(std::span<const std::byte> mine) = 0;

  void barrier();
};

// Adapts any all-gather function (the Python layer passes one built on
// torch.distributed or mpi4py).
class FunctionBootstrap final : public Bootstrap {
 public:
  using AllGather = std::function<std::vector<std::byte>(std::span<const std::byte>)>;
  FunctionBootstrap(int rank, int size, AllGather all_gather);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<std::byte> all_gather(std::span<const std::byte> mine) override;

 private:
  int rank_;
  int size_;
  AllGather all_gather_;
};

// For C++ programs with no launcher of their own: rank 0 listens on
// host:port, the others connect to it; rank 0 gathers and sends back.
class TcpBootstrap final : public Bootstrap {
 public:
  TcpBootstrap(int rank, int size, const std::string& root_host, uint16_t port,
               std::chrono::milliseconds timeout = std::chrono::seconds(100));
  ~TcpBootstrap() override;
  TcpBootstrap(const TcpBootstrap&) = delete;
  TcpBootstrap& operator=(const TcpBootstrap&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<std::byte> all_gather(std::span<const std::byte> mine) override;

 private:
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  int listen_fd_ = -1;
  std::vector<int> peer_fds_;  // rank 0: one per other rank (index = rank); others: [0] = root
};

}  // namespace turnout
