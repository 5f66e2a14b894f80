// The NVSHMEM transport's loader (runtime/nvshmem_loader.hpp) where it must
// refuse: no library at the path, a library without turnout's symbol, one of
// another build. Each refusal is NotSupported naming the path and how to get
// the transport; an NvshmemWindow passes it on and can be tried again.
#include <gtest/gtest.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/nvshmem_loader.hpp"
#include "runtime/nvshmem_window.hpp"
#include "turnout/bootstrap.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

// Sets TURNOUT_NVSHMEM_LIB (or unsets it) for one test, then puts it back.
class LibraryVariable {
 public:
  explicit LibraryVariable(const char* value) {
    if (const char* old = std::getenv(kName)) old_ = old;
    if (value)
      setenv(kName, value, 1);
    else
      unsetenv(kName);
  }
  ~LibraryVariable() {
    if (old_)
      setenv(kName, old_->c_str(), 1);
    else
      unsetenv(kName);
  }
  LibraryVariable(const LibraryVariable&) = delete;
  LibraryVariable& operator=(const LibraryVariable&) = delete;

 private:
  static constexpr const char* kName = "TURNOUT_NVSHMEM_LIB";
  std::optional<std::string> old_;
};

template <class F>
std::string not_supported_message(F&& call) {
  try {
    call();
  } catch (const NotSupported& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected NotSupported, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected NotSupported, nothing was thrown";
  return {};
}

void expect_contains(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "'" << needle << "' not in: " << text;
}

TEST(NvshmemLoader, MissingLibraryNamesItsPathAndTheWheel) {
  const char* path = "/nonexistent/turnout/libturnout_nvshmem.so";
  LibraryVariable variable(path);
  EXPECT_EQ(nvshmem_library_path(), path);
  const std::string message = not_supported_message([] { nvshmem_api(); });
  expect_contains(message, path);
  expect_contains(message, "could not be loaded");
  expect_contains(message, "pip install nvidia-nvshmem-cu13==3.4.5");
  expect_contains(message, "TURNOUT_NVSHMEM_LIB");
}

TEST(NvshmemLoader, LibraryWithoutTheSymbolIsRefused) {
  LibraryVariable variable("libc.so.6");
  const std::string message = not_supported_message([] { nvshmem_api(); });
  expect_contains(message, "libc.so.6");
  expect_contains(message, "has no symbol turnout_nvshmem_api_v1");
}

TEST(NvshmemLoader, LibraryOfAnotherBuildIsRefused) {
  LibraryVariable variable(TURNOUT_TEST_STALE_NVSHMEM_LIB);
  const std::string message = not_supported_message([] { nvshmem_api(); });
  expect_contains(message, TURNOUT_TEST_STALE_NVSHMEM_LIB);
  expect_contains(message, "version " + std::to_string(TURNOUT_NVSHMEM_API_VERSION + 1));
  expect_contains(message, "another build of turnout");
}

TEST(NvshmemLoader, LooksBesideTheProgramThatHoldsTheCore) {
  LibraryVariable variable(nullptr);
  char exe[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  ASSERT_GT(n, 0);
  const std::string program(exe, static_cast<size_t>(n));
  EXPECT_EQ(nvshmem_library_path(), program.substr(0, program.rfind('/') + 1) + "libturnout_nvshmem.so");
}

TEST(NvshmemWindow, PassesTheLoadersRefusalOnAndCanBeTriedAgain) {
  const char* path = "/nonexistent/turnout/libturnout_nvshmem.so";
  LibraryVariable variable(path);
  FunctionBootstrap alone(
      0, 1, [](std::span<const std::byte> mine) { return std::vector<std::byte>(mine.begin(), mine.end()); });
  // The second try finds no window open: the first released its claim.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const std::string message = not_supported_message([&] { NvshmemWindow window(alone); });
    expect_contains(message, path);
    EXPECT_EQ(message.find("already open"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace turnout
